"""FIRE, FoX and DAPE train a tiny model through fairseq-train's main (in this process) with falling
loss, and the checkpoint reloads and evaluates at 8x the training length with kerple-eval-lm."""

import json
import math

import pytest
import torch

from kerple_fairseq.experiments.language_models import model_size_flags

from conftest import TRAIN_LENGTH, train_in_process

SIZE = model_size_flags(layers=2, width=32, heads=4)
UPDATES = 12
RUNS = {
    "fire": ["--bias-kernel", "fire"],
    "fox": ["--bias-kernel", "fox"],
    "fox_bias_only": ["--bias-kernel", "fox_bias_only"],
    "dape-mlp-alibi": ["--bias-kernel", "alibi", "--dape", "mlp"],
    "dape-conv-kerple_log": ["--bias-kernel", "kerple_log", "--dape", "conv"],
    "dape-conv-fire": ["--bias-kernel", "fire", "--dape", "conv"],
    "dape-mlp-rotary": ["--arch", "transformer_lm_rotary", "--dape", "mlp"],
}


@pytest.mark.parametrize("run", sorted(RUNS))
def test_trains_with_falling_loss_and_evaluates_at_8x_the_training_length(data_bin, tmp_path, run):
    from kerple_fairseq.evaluation.cli import cli_main

    flags = RUNS[run]
    arch = [] if "--arch" in flags else ["--arch", "transformer_lm_kerple"]
    losses = train_in_process(data_bin, tmp_path, UPDATES, *arch, *SIZE, *flags)
    assert len(losses) == UPDATES and all(math.isfinite(x) for x in losses), losses
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 0.4, f"{run}: loss {first:.2f} -> {last:.2f}"

    checkpoint = tmp_path / "checkpoint_last.pt"
    model = torch.load(checkpoint, map_location="cpu", weights_only=False)["model"]
    if "fire" in flags or "fox" in flags or "fox_bias_only" in flags:
        assert any(".self_attn.layer_bias." in k for k in model)
    if "--dape" in flags:
        assert any(".self_attn.score_transform." in k for k in model)
    results = tmp_path / "results.json"
    with pytest.raises(SystemExit) as exit_info:
        cli_main([str(data_bin), "--path", str(checkpoint), "--gen-subset", "valid", "--cpu", "--no-progress-bar",
                  "--lengths", str(TRAIN_LENGTH), str(8 * TRAIN_LENGTH), "--max-tokens", "4096",
                  "--results-json", str(results)])
    assert exit_info.value.code == 0
    records = {r["length"]: r for r in json.load(open(results))}
    assert set(records) == {TRAIN_LENGTH, 8 * TRAIN_LENGTH}
    assert all(math.isfinite(r["ppl"]) and r["num_tokens"] > 8 * TRAIN_LENGTH for r in records.values())
    assert records[8 * TRAIN_LENGTH]["train_length"] == TRAIN_LENGTH
