"""FIRE, FoX, DAPE, xPos, CoPE, stick-breaking, selective attention, scalable softmax, PaTH (and PaTH-FoX)
and BAM with scalable softmax train a tiny
model through fairseq-train's main (in this process) with falling loss, and the checkpoint reloads and
evaluates at 8x the training length with kerple-eval-lm (the rules after FoX, and ReRoPE and Llama 4's
temperature on a rotary checkpoint, at 32x)."""

import json
import math

import numpy as np
import pytest
import torch

from kerple_fairseq.experiments.language_models import model_size_flags

from conftest import TRAIN_LENGTH, assert_finite_falling_loss, train_in_process

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
    "xpos": ["--arch", "transformer_lm_rotary", "--rotary-xpos"],
    "cope": ["--arch", "transformer_lm_cope"],
    "cope-alibi": ["--bias-kernel", "alibi", "--cope"],
}


def evaluate(data_bin, checkpoint, results, lengths, *flags):
    """kerple-eval-lm of ``checkpoint`` at ``lengths`` (both protocols); its records by length and protocol."""
    from kerple_fairseq.evaluation.cli import cli_main

    with pytest.raises(SystemExit) as exit_info:
        cli_main([str(data_bin), "--path", str(checkpoint), "--gen-subset", "valid", "--cpu", "--no-progress-bar",
                  "--lengths", *map(str, lengths), "--max-tokens", "4096", "--results-json", str(results), *flags])
    assert exit_info.value.code == 0
    return {(r["length"], r["protocol"]): r for r in json.load(open(results))}


RULE_RUNS = {
    "stick_breaking": ["--bias-kernel", "none", "--stick-breaking"],
    "selective": ["--bias-kernel", "none", "--selective-attention"],
    "ssmax": ["--arch", "transformer_lm_rotary", "--ssmax"],
    "rotary": ["--arch", "transformer_lm_rotary"],
    "path": ["--bias-kernel", "none", "--path-attention"],
    "path_fox": ["--bias-kernel", "fox", "--path-attention"],
    "bam_ssmax": ["--bias-kernel", "bam", "--ssmax", "--ssmax-scale-init", "1"],
}
#: how each rotary checkpoint is also evaluated
ROTARY_EVALUATIONS = {"rerope": ["--rotary-scaling", "rerope"], "leaky-rerope": ["--rotary-scaling", "leaky-rerope"],
                      "llama4-temperature": ["--model-overrides", "{'attn_temperature_tuning': True, "
                                             "'attn_temperature_floor_scale': 128, 'attn_temperature_layers': 'all'}"]}


@pytest.mark.parametrize("run", sorted(RULE_RUNS))
def test_rules_after_fox_train_with_falling_loss_and_evaluate_at_32x(data_bin, tmp_path, run):
    flags = RULE_RUNS[run]
    arch = [] if "--arch" in flags else ["--arch", "transformer_lm_kerple"]
    losses = train_in_process(data_bin, tmp_path, UPDATES, *arch, *SIZE, *flags)
    assert_finite_falling_loss(losses, UPDATES, run)
    checkpoint = tmp_path / "checkpoint_last.pt"
    if run == "ssmax":  # each layer's scales are learned, and kerple-analyze kernels reports them
        import csv

        from kerple_fairseq.analysis.cli import cli_main as analyze

        model = torch.load(checkpoint, map_location="cpu", weights_only=True)["model"]
        scales = [model[f"decoder.layers.{n}.self_attn.query_scales.0.scale"] for n in range(2)]
        assert all((s - 0.43).abs().max() > 1e-4 for s in scales)
        analyze(["kernels", "--path", str(checkpoint), "--labels", "ssmax", "--max-distance", "64",
                 "--out", str(tmp_path / "a")])
        rows = list(csv.DictReader(open(tmp_path / "a" / "kernel-parameters.csv")))
        reported = {(r["parameter"], int(r["head"])): float(r["value"]) for r in rows}
        assert reported == {(f"ssmax_s/layer{n + 1}", h + 1): scales[n][h].item() for n in range(2) for h in range(4)}
    if run in ("stick_breaking", "selective"):  # their recency is drawn from their attention weights
        from kerple_fairseq.analysis.cli import cli_main as analyze

        analyze(["attention", str(data_bin), "--path", str(checkpoint), "--labels", run, "--length", "128",
                 "--num-segments", "2", "--cpu", "--no-progress-bar", "--out", str(tmp_path / "a")])
        summary = json.load(open(tmp_path / "a" / "attention.json"))[run]
        distances = np.array(summary["mean_attended_distance"])
        assert distances.shape == (2, 4) and ((distances > 0) & (distances < 128)).all()
        assert sum(1 for _ in open(tmp_path / "a" / "attention.csv")) == 1 + 2 * 4 * 128
    lengths = [TRAIN_LENGTH, 32 * TRAIN_LENGTH]
    evaluations = {run: []}
    if "transformer_lm_rotary" in flags and run == "rotary":
        evaluations.update(ROTARY_EVALUATIONS)
    records = {}
    for name, eval_flags in evaluations.items():
        records[name] = evaluate(data_bin, checkpoint, tmp_path / f"{name}.json", lengths, *eval_flags)
        assert {length for length, _ in records[name]} == set(lengths)
        assert all(math.isfinite(r["ppl"]) for r in records[name].values())
    if run == "rotary":  # each evaluation option changes the long lengths' result and leaves the training length's
        long = (32 * TRAIN_LENGTH, "early-token-cursed")
        for name in ROTARY_EVALUATIONS:
            assert records[name][long]["ppl"] != records["rotary"][long]["ppl"], name
        short = (TRAIN_LENGTH, "early-token-cursed")
        assert records["llama4-temperature"][short]["ppl"] == records["rotary"][short]["ppl"]


@pytest.mark.parametrize("run", sorted(RUNS))
def test_trains_with_falling_loss_and_evaluates_at_8x_the_training_length(data_bin, tmp_path, run):
    from kerple_fairseq.evaluation.cli import cli_main

    flags = RUNS[run]
    arch = [] if "--arch" in flags else ["--arch", "transformer_lm_kerple"]
    losses = train_in_process(data_bin, tmp_path, UPDATES, *arch, *SIZE, *flags)
    assert_finite_falling_loss(losses, UPDATES, run)

    checkpoint = tmp_path / "checkpoint_last.pt"
    model = torch.load(checkpoint, map_location="cpu", weights_only=True)["model"]
    if "fire" in flags or "fox" in flags or "fox_bias_only" in flags:
        assert any(".self_attn.layer_bias." in k for k in model)
    if "--dape" in flags:
        assert any(".self_attn.score_transform." in k for k in model)
    if run.startswith("cope"):  # the tables start at zero and are learned
        assert all(model[f"decoder.layers.{n}.self_attn.score_transform.embeddings"].abs().max() > 0 for n in range(2))
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


@pytest.mark.parametrize("kernel", ["fire", "fox", "fox_bias_only"])
def test_kernel_curves_effective_lengths_and_receptive_field_of_each_layer(data_bin, tmp_path, kernel, capsys):
    """kerple-analyze draws a layer bias per layer and head: FIRE's row of the query at the largest
    distance, FoX's mean forget-gate decay over the split's inputs (which it needs: --data)."""
    import csv

    from kerple_fairseq.analysis.cli import cli_main
    from kerple_fairseq.analysis.kernel_curves import load_kernel

    train_in_process(data_bin, tmp_path, 4, "--arch", "transformer_lm_kerple", *SIZE, "--bias-kernel", kernel)
    checkpoint = str(tmp_path / "checkpoint_last.pt")
    if kernel == "fox":
        with pytest.raises(SystemExit) as exit_info:
            cli_main(["kernels", "--path", checkpoint, "--out", str(tmp_path / "a")])
        assert exit_info.value.code == 1
        assert "depends on the input: give --data DIR" in capsys.readouterr().err
    for analysis in ("kernels", "effective-length"):
        cli_main([analysis, "--path", checkpoint, "--labels", kernel, "--data", str(data_bin),
                  "--max-distance", "256", "--out", str(tmp_path / "a")])
    rows = list(csv.DictReader(open(tmp_path / "a" / "kernels.csv")))
    assert {(r["layer"], r["head"]) for r in rows} == {(str(l), str(h)) for l in (1, 2) for h in (1, 2, 3, 4)}
    curves = load_kernel(checkpoint, kernel, str(data_bin)).curves(256)
    assert curves.shape == (8, 257) and np.isfinite(curves).all() and (curves[:, 0] == 0).all()
    if kernel != "fire":  # d * mean(log f): a straight line down from 0
        slopes = curves[:, 1]
        assert (slopes < 0).all()
        np.testing.assert_allclose(curves, slopes[:, None] * np.arange(257), rtol=1e-5)
    lengths = list(csv.DictReader(open(tmp_path / "a" / "effective-length.csv")))
    assert len(lengths) == 8
    cli_main(["receptive-field", str(data_bin), "--path", checkpoint, "--length", "128", "--num-segments", "2",
              "--cpu", "--no-progress-bar", "--out", str(tmp_path / "a")])
    assert (tmp_path / "a" / "receptive-field.json").is_file()


def test_cope_curves_add_the_mean_term_by_distance_to_the_kernel(data_bin, tmp_path, capsys, monkeypatch):
    """kerple-analyze draws CoPE over ALiBi per layer and head as ALiBi's bias plus CoPE's term averaged
    over every query and key d apart (relative to d = 0), which a loop over the pairs reproduces."""
    from kerple_fairseq.analysis import cope_curves
    from kerple_fairseq.analysis.cli import cli_main
    from kerple_fairseq.analysis.kernel_curves import load_kernel
    from kerple_fairseq.evaluation.loading import load_language_model, token_stream
    from kerple_core.kernels.alibi import alibi_slopes

    train_in_process(data_bin, tmp_path, 4, "--arch", "transformer_lm_alibi", *SIZE, "--cope",
                     "--attention-block-size", "16")  # the curves come from blocks of 16, 16 and 8 queries
    checkpoint = str(tmp_path / "checkpoint_last.pt")
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["kernels", "--path", checkpoint, "--out", str(tmp_path / "a")])
    assert exit_info.value.code == 1
    assert "depends on the input: give --data DIR" in capsys.readouterr().err
    monkeypatch.setattr(cope_curves, "CURVE_TOKENS", 120)
    curves = load_kernel(checkpoint, "cope", str(data_bin)).curves(39)  # 3 segments of 40 tokens

    model, task, _ = load_language_model(checkpoint, str(data_bin))
    model.eval()
    model.decoder.setup.block_size = 0  # here one block of 40 queries
    captured = {n: [] for n in range(2)}
    for n, layer in enumerate(model.decoder.layers):
        layer.self_attn.score_transform.register_forward_hook(
            lambda module, inputs, logits, n=n: captured[n].append((logits - inputs[1] - inputs[2])[0].double()))
    stream = token_stream(task, str(data_bin), "valid")
    with torch.no_grad():
        for start in (0, 40, 80):
            model(stream[start:start + 40][None])
    slopes = alibi_slopes(4)
    for n in range(2):
        for h in range(4):
            means = []
            for d in range(40):
                cells = [term[h, t, t - d].item() for term in captured[n] for t in range(d, 40)]
                means.append(sum(cells) / len(cells))
            expected = -slopes[h] * np.arange(40) + np.array(means) - means[0]
            np.testing.assert_allclose(curves[4 * n + h], expected, rtol=0, atol=1e-5)
    terms = curves + np.tile(slopes, 2)[:, None] * np.arange(40)
    assert np.ptp(terms, axis=1).max() > 1e-4, "a trained term varies with distance"
