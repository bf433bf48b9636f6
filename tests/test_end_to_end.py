"""fairseq-preprocess -> fairseq-train -> fairseq-eval-lm with the plugin, on the real sample."""

import json
import math
import re

import pytest
import torch

from conftest import REPO, fairseq_cli, run

TRAIN_LENGTH = 64
TRAIN = ["--task", "language_modeling", "--user-dir", "kerple_fairseq",
         "--decoder-layers", "2", "--decoder-embed-dim", "64", "--decoder-ffn-embed-dim", "128",
         "--decoder-attention-heads", "4", "--dropout", "0.1",
         "--tokens-per-sample", str(TRAIN_LENGTH), "--sample-break-mode", "none", "--max-tokens", "1024",
         "--optimizer", "adam", "--lr", "0.003", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "5",
         "--cpu", "--seed", "3", "--log-format", "json", "--log-interval", "1", "--num-workers", "0",
         "--disable-validation", "--no-epoch-checkpoints"]
UPDATES = 40


def train(data_bin, save_dir, kernel, updates, *extra):
    proc = run([fairseq_cli("fairseq-train"), data_bin, "--arch", "transformer_lm_kerple", "--bias-kernel", kernel,
                *TRAIN, "--max-update", str(updates), "--save-dir", save_dir, *extra])
    return [float(json.loads(line[line.index("{"):])["loss"]) for line in (proc.stdout + proc.stderr).splitlines()
            if "train_inner" in line and "{" in line]


def eval_lm(data_bin, checkpoint, length, *extra):
    proc = run([fairseq_cli("fairseq-eval-lm"), data_bin, "--path", checkpoint, "--gen-subset", "valid",
                "--tokens-per-sample", str(length), "--context-window", "0", "--max-sentences", "1",
                "--cpu", "--num-workers", "0", *extra])
    out = proc.stdout + proc.stderr
    tokens = int(re.search(r"Evaluated ([\d,]+) tokens", out).group(1).replace(",", ""))
    loss, ppl = map(float, re.search(r"Loss \(base 2\): ([\d.]+), Perplexity: ([\d.]+)", out).groups())
    return tokens, loss, ppl


@pytest.fixture(scope="module", params=["alibi", "kerple_log"])
def trained(request, data_bin, tmp_path_factory):
    save_dir = tmp_path_factory.mktemp(f"ckpt-{request.param}")
    losses = train(data_bin, save_dir, request.param, UPDATES)
    return request.param, save_dir, losses


def test_training_loss_falls(trained):
    kernel, _, losses = trained
    assert len(losses) == UPDATES
    assert all(math.isfinite(x) for x in losses)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 1.0, f"{kernel}: loss {first:.2f} -> {last:.2f}"


def test_checkpoint_holds_one_set_of_valid_kernel_parameters(trained):
    kernel, save_dir, _ = trained
    state = torch.load(save_dir / "checkpoint_last.pt", map_location="cpu", weights_only=False)
    kernel_keys = sorted(k for k in state["model"] if "attention_bias" in k)
    assert state["cfg"]["model"]["bias_kernel"] == kernel
    assert state["cfg"]["model"]["no_token_positional_embeddings"] is True
    assert not any("embed_positions" in k for k in state["model"])
    if kernel == "kerple_log":
        from kerple_fairseq.kernels.constraints import positive

        assert kernel_keys == ["decoder.attention_bias.kernel.r1_raw", "decoder.attention_bias.kernel.r2_raw"]
        for key in kernel_keys:
            assert state["model"][key].shape == (4,)
            assert (positive(state["model"][key], 1e-2) > 1e-2).all()
    else:
        assert kernel_keys == []


def test_resume_from_checkpoint_last_reaches_the_same_parameters(trained, data_bin, tmp_path):
    kernel, straight_dir, _ = trained
    train(data_bin, tmp_path, kernel, UPDATES // 2)
    train(data_bin, tmp_path, kernel, UPDATES)  # resumes from checkpoint_last.pt
    straight = torch.load(straight_dir / "checkpoint_last.pt", map_location="cpu", weights_only=False)["model"]
    resumed = torch.load(tmp_path / "checkpoint_last.pt", map_location="cpu", weights_only=False)["model"]
    assert straight.keys() == resumed.keys()
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], rtol=0, atol=1e-6, msg=key)


def test_stock_eval_lm_at_1x_and_8x_the_training_length(trained, data_bin):
    _, save_dir, _ = trained
    results = {}
    for length in (TRAIN_LENGTH, 8 * TRAIN_LENGTH):
        tokens, loss, ppl = eval_lm(data_bin, save_dir / "checkpoint_last.pt", length, "--user-dir", "kerple_fairseq")
        assert tokens > 20_000, "every token of the split is scored, none skipped"
        assert math.isfinite(loss) and 1.0 < ppl < 8000
        results[length] = tokens
    # non-overlapping blocks score every token at both lengths
    assert results[TRAIN_LENGTH] == results[8 * TRAIN_LENGTH]
