"""fairseq-preprocess -> fairseq-train -> fairseq-eval-lm with the plugin, on the real sample.

The ``trained`` models come from fairseq-train's main in the test process; a fairseq-train
process with ``--user-dir`` resumes them here, to the same parameters."""

import math

import pytest
import torch

from conftest import TRAIN_LENGTH, UPDATES, stock_eval_lm, train

KERNELS = ["alibi", "kerple_log"]


@pytest.mark.parametrize("kernel", KERNELS)
def test_training_loss_falls(trained, kernel):
    _, losses = trained[kernel]
    assert len(losses) == UPDATES
    assert all(math.isfinite(x) for x in losses)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 1.0, f"{kernel}: loss {first:.2f} -> {last:.2f}"


@pytest.mark.parametrize("kernel", KERNELS)
def test_checkpoint_holds_one_set_of_valid_kernel_parameters(trained, kernel):
    save_dir, _ = trained[kernel]
    state = torch.load(save_dir / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    kernel_keys = sorted(k for k in state["model"] if "attention_bias" in k)
    assert state["cfg"]["model"]["bias_kernel"] == kernel
    assert state["cfg"]["model"]["no_token_positional_embeddings"] is True
    assert not any("embed_positions" in k for k in state["model"])
    if kernel == "kerple_log":
        assert kernel_keys == ["decoder.attention_bias.kernel.r1", "decoder.attention_bias.kernel.r2"]
        for key in kernel_keys:
            assert state["model"][key].shape == (4,) and torch.isfinite(state["model"][key]).all()
    else:
        assert kernel_keys == []


@pytest.mark.slow
@pytest.mark.parametrize("kernel", KERNELS)
def test_resume_from_checkpoint_last_reaches_the_same_parameters(trained, data_bin, tmp_path, kernel):
    straight_dir, _ = trained[kernel]
    flags = ["--arch", "transformer_lm_kerple", "--bias-kernel", kernel]
    train(data_bin, tmp_path, UPDATES // 2, *flags)  # fairseq-train processes
    train(data_bin, tmp_path, UPDATES, *flags)  # resumes from checkpoint_last.pt
    straight = torch.load(straight_dir / "checkpoint_last.pt", map_location="cpu", weights_only=True)["model"]
    resumed = torch.load(tmp_path / "checkpoint_last.pt", map_location="cpu", weights_only=True)["model"]
    assert straight.keys() == resumed.keys()
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], rtol=0, atol=1e-6, msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", KERNELS)
def test_stock_eval_lm_at_1x_and_8x_the_training_length(trained, data_bin, kernel):
    save_dir, _ = trained[kernel]
    results = {}
    for length in (TRAIN_LENGTH, 8 * TRAIN_LENGTH):
        tokens, loss, ppl = stock_eval_lm(data_bin, save_dir / "checkpoint_last.pt", length, "--user-dir", "kerple_fairseq")
        assert tokens > 20_000, "every token of the split is scored, none skipped"
        assert math.isfinite(loss) and 1.0 < ppl < 8000
        results[length] = tokens
    # non-overlapping blocks score every token at both lengths
    assert results[TRAIN_LENGTH] == results[8 * TRAIN_LENGTH]
