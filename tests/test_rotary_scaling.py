"""NTK-aware (static and dynamic) and YaRN scaling of rotary at evaluation, against plain float64
loops of their formulas, on every decoding path, from kerple-eval-lm and from stock fairseq-eval-lm."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from kerple_core.attention.blocks import query_blocks
from kerple_core.attention.rotary import RotaryEmbedding
from kerple_core.attention.self_attention import recorded
from kerple_fairseq.errors import KernelConfigError

from conftest import REPO, train_in_process
from console_scripts import run_forked
from helpers import tiny_model
from test_decoding_paths_of_newer_methods import beam_search_matches_full_scoring
from test_layer_biases import log_probs, tokens_of

DIM, TRAIN = 16, 8


def rotary_with(head_dim=DIM, train_length=0, **options):
    """The rotary embedding of ``head_dim`` with the model options ``options`` (the others their defaults)."""
    return RotaryEmbedding(head_dim, SimpleNamespace(**options), train_length=train_length)


def ntk_frequencies(s):
    base = 10000.0 * s ** (DIM / (DIM - 2))
    return [base ** (-2.0 * k / DIM) for k in range(DIM // 2)]


def yarn_frequencies(s, train_length=TRAIN):
    def d(r):
        return DIM * math.log(train_length / (2 * math.pi * r)) / (2 * math.log(10000.0))

    low, high = max(math.floor(d(32)), 0), min(math.ceil(d(1)), DIM - 1)
    out = []
    for k in range(DIM // 2):
        theta = 10000.0 ** (-2.0 * k / DIM)
        gamma = min(max((k - low) / max(high - low, 1e-3), 0.0), 1.0)
        out.append((1 - gamma) * theta + gamma * theta / s)
    return out


def logit_reference(q, k, n, m, frequencies, magnitude=1.0):
    """Rotated ``q`` at ``n`` dotted with rotated ``k`` at ``m``, pairs ``(j, j + D/2)``, times ``magnitude^2``."""
    half = len(q) // 2
    total = 0.0
    for j, theta in enumerate(frequencies):
        def rotated(x, p):
            a, b = x[j], x[j + half]
            return a * math.cos(p * theta) - b * math.sin(p * theta), a * math.sin(p * theta) + b * math.cos(p * theta)
        (qa, qb), (ka, kb) = rotated(q, n), rotated(k, m)
        total += (qa * ka + qb * kb) * magnitude ** 2
    return total


@pytest.mark.parametrize("scaling, length, frequencies, magnitude", [
    ("ntk", 32, ntk_frequencies(4.0), 1.0),
    ("yarn", 32, yarn_frequencies(4.0), 0.1 * math.log(4.0) + 1),
    ("yarn", 1000, yarn_frequencies(125.0), 0.1 * math.log(125.0) + 1),
])
def test_scaled_logits_equal_the_formulas_by_loops(scaling, length, frequencies, magnitude):
    rotary = rotary_with(train_length=TRAIN, rotary_scaling=scaling, rotary_scaling_length=length)
    torch.testing.assert_close(rotary.inverse_frequencies(rotary.scale_factor()),
                               torch.tensor(frequencies, dtype=torch.float64), rtol=1e-12, atol=0)
    assert_logits_by_loops(rotary, frequencies, magnitude, tolerance=1e-10)


def assert_logits_by_loops(rotary, frequencies, magnitude=1.0, tolerance=1e-12):
    """6 queries from position 14 against 20 keys from 0, rotated by ``rotary``, against :func:`logit_reference`."""
    torch.manual_seed(0)
    q, k = torch.randn(6, DIM, dtype=torch.float64), torch.randn(20, DIM, dtype=torch.float64)
    (q_rot,), (k_rot,) = rotary(q, offset=14), rotary(k, offset=0)
    logits = q_rot @ k_rot.T
    for t in range(6):
        for s in range(20):
            expected = logit_reference(q[t].tolist(), k[s].tolist(), 14 + t, s, frequencies, magnitude)
            assert abs(logits[t, s].item() - expected) < tolerance, (t, s)


def dynamic_scale_reference(position, step, train_length=TRAIN):
    """The length reached by the query at ``position``, rounded up to the training length plus a
    multiple of ``step``, over the training length; 1 within the training length."""
    reached = position + 1
    if reached <= train_length:
        return 1.0
    return (train_length + math.ceil((reached - train_length) / step) * step) / train_length


@pytest.mark.parametrize("step", [1, 3, 16])
def test_dynamic_ntk_logits_equal_the_formula_by_loops(step):
    """Each query attends with the NTK base of the length it has reached, against every key rotated
    with that base; the blocks of the attention follow the bands of one scale."""
    rotary = rotary_with(train_length=TRAIN, rotary_scaling="dynamic-ntk", dynamic_ntk_step=step)
    torch.manual_seed(0)
    num = 30
    q, k = torch.randn(num, DIM, dtype=torch.float64), torch.randn(num, DIM, dtype=torch.float64)
    q_rot, k_rot = rotary(q, k, offset=0)
    logits = torch.full((num, num), float("nan"), dtype=torch.float64)
    for block in query_blocks(num, num, starts=rotary.band_starts(0, num)):
        qb, kb = rotary.per_block(q_rot[block.query_start:block.query_end], k_rot[block.key_start:block.key_end],
                                  block.query_start, block.key_start)
        logits[block.query_start:block.query_end, block.key_start:block.key_end] = qb @ kb.T
    for t in range(num):
        frequencies = ntk_frequencies(dynamic_scale_reference(t, step))
        for s in range(t + 1):
            expected = logit_reference(q[t].tolist(), k[s].tolist(), t, s, frequencies)
            assert abs(logits[t, s].item() - expected) < 1e-10, (t, s)


def test_dynamic_ntk_bands_start_where_the_scale_changes():
    rotary = rotary_with(train_length=TRAIN, rotary_scaling="dynamic-ntk", dynamic_ntk_step=3)
    assert rotary.band_starts(0, 16) == [8, 11, 14]
    assert rotary.band_starts(9, 7) == [2, 5]  # queries at 9 .. 15: bands start at 11 and 14
    assert rotary.band_starts(11, 1) == [] and rotary.band_starts(0, 8) == []
    for first, count in ((0, 30), (5, 20), (13, 9)):
        bounds = [0] + rotary.band_starts(first, count) + [count]
        for start, end in zip(bounds, bounds[1:]):
            scales = {dynamic_scale_reference(first + t, 3) for t in range(start, end)}
            assert len(scales) == 1, (first, start, end)
        assert all(dynamic_scale_reference(first + t - 1, 3) != dynamic_scale_reference(first + t, 3)
                   for t in bounds[1:-1])


def test_yarn_keeps_fast_dimensions_and_interpolates_slow_ones():
    rotary = rotary_with(128, train_length=512, rotary_scaling="yarn", rotary_scaling_length=2048)
    plain = RotaryEmbedding(128).inverse_frequencies(1.0)
    scaled = rotary.inverse_frequencies(4.0)
    assert scaled[0] == plain[0] and torch.allclose(scaled[-1], plain[-1] / 4)
    assert ((scaled <= plain) & (scaled >= plain / 4)).all()


@pytest.mark.parametrize("scaling", ["ntk", "yarn"])
def test_no_scaling_up_to_the_training_length(scaling):
    q = torch.randn(2, 4, 8, DIM)
    plain = RotaryEmbedding(DIM)(q, q, offset=0)
    scaled = rotary_with(train_length=TRAIN, rotary_scaling=scaling, rotary_scaling_length=TRAIN)(q, q, offset=0)
    assert all(torch.equal(a, b) for a, b in zip(plain, scaled))


def scaled_model(scaling, *flags):
    step = ("--dynamic-ntk-step", "3") if scaling == "dynamic-ntk" else ()
    return tiny_model("none", "--tokens-per-sample", str(TRAIN), "--rotary-scaling", scaling,
                      "--rotary-scaling-length", "32", *step, *flags, arch="transformer_lm_rotary")


@pytest.mark.parametrize("scaling", ["ntk", "dynamic-ntk", "yarn"])
def test_incremental_decoding_blocks_and_beam_search_equal_full_scoring(scaling):
    torch.manual_seed(0)
    model = scaled_model(scaling).double().eval()
    blocked = scaled_model(scaling, "--attention-block-size", "4").double().eval()
    blocked.load_state_dict(model.state_dict())
    tokens = tokens_of()
    full = log_probs(model, tokens)
    assert (full - log_probs(model, tokens, incremental=True)).abs().max() < 1e-6
    torch.testing.assert_close(log_probs(blocked, tokens), full, rtol=0, atol=1e-6)
    plain = tiny_model("none", "--tokens-per-sample", str(TRAIN), arch="transformer_lm_rotary").double().eval()
    plain.load_state_dict(model.state_dict())
    assert (log_probs(plain, tokens) - full).abs().max() > 1e-3, "the scaling changes the model"
    beam_search_matches_full_scoring(scaled_model(scaling).eval())


@pytest.mark.parametrize("flags", [(), ("--rotary-xpos",)], ids=["rotary", "xpos"])
def test_dynamic_ntk_weights_and_scores_cover_every_band(flags):
    """Probabilities and the recorded logits come laid out over all keys although the bands
    attend block by block, and agree with the attended values."""
    torch.manual_seed(0)
    model = scaled_model("dynamic-ntk", *flags).double().eval()
    attention = model.decoder.layers[0].self_attn
    x = torch.randn(20, 2, attention.embed_dim, dtype=torch.float64)
    with torch.no_grad():
        out, weights = attention(x, x, x, need_weights=True, need_head_weights=True)
        plain_out, _ = attention(x, x, x, need_weights=False)
        with recorded(attention, keep_logits=True) as record:
            attention(x, x, x, need_weights=False)
        values = attention.v_proj(x).view(20, 2, -1, attention.head_dim).permute(1, 2, 0, 3)  # [B, H, T, D]
    torch.testing.assert_close(out, plain_out, rtol=0, atol=1e-12)
    probabilities = torch.softmax(record.logits[0], dim=-1)  # [B, H, T, S]
    torch.testing.assert_close(record.probabilities[0], probabilities, rtol=0, atol=1e-12)
    torch.testing.assert_close(weights, probabilities.transpose(0, 1), rtol=0, atol=1e-12)
    assert torch.equal(weights.triu(1), torch.zeros_like(weights)), "no weight on future keys"
    attended = torch.matmul(probabilities, values)  # [B, H, T, D]
    expected = attention.out_proj(attended.permute(2, 0, 1, 3).reshape(20, 2, -1))
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)


def test_bad_scaling_options_are_clear_errors():
    with pytest.raises(KernelConfigError, match="--rotary-scaling changes rotary embeddings"):
        tiny_model("alibi", "--rotary-scaling", "yarn")
    with pytest.raises(KernelConfigError, match="--rotary-scaling-length must be >= 0"):
        scaled_model("yarn", "--rotary-scaling-length", "-1")
    with pytest.raises(KernelConfigError, match="--dynamic-ntk-step must be >= 1"):
        scaled_model("dynamic-ntk", "--dynamic-ntk-step", "0")


@pytest.fixture(scope="module")
def rotary_checkpoint(data_bin, tmp_path_factory):
    from kerple_fairseq.experiments.language_models import model_size_flags

    save_dir = tmp_path_factory.mktemp("rotary")
    train_in_process(data_bin, save_dir, 6, "--arch", "transformer_lm_rotary",
                     *model_size_flags(layers=2, width=32, heads=4))
    return save_dir / "checkpoint_last.pt"


def eval_lm(data_bin, checkpoint, tmp_path, *flags):
    from kerple_fairseq.evaluation.cli import cli_main

    out = tmp_path / f"r{len(list(tmp_path.iterdir()))}.json"
    with pytest.raises(SystemExit) as exit_info:
        cli_main([str(data_bin), "--path", str(checkpoint), "--gen-subset", "valid", "--cpu", "--no-progress-bar",
                  "--max-tokens", "4096", "--results-json", str(out), *flags])
    assert exit_info.value.code == 0
    return {r["length"]: r["ppl"] for r in json.load(open(out))}


def test_kerple_eval_lm_scales_by_each_length_over_the_training_length(data_bin, rotary_checkpoint, tmp_path):
    plain = eval_lm(data_bin, rotary_checkpoint, tmp_path, "--lengths", "64", "256")
    for scaling in ("ntk", "dynamic-ntk", "yarn"):
        scaled = eval_lm(data_bin, rotary_checkpoint, tmp_path, "--lengths", "64", "256", "--rotary-scaling", scaling)
        assert scaled[64] == pytest.approx(plain[64], rel=1e-9), "s = 1 at the training length"
        assert abs(scaled[256] - plain[256]) > 1e-6 * plain[256], scaling  # a barely trained model: small but real


@pytest.mark.slow
def test_stock_fairseq_eval_lm_through_model_overrides(data_bin, rotary_checkpoint, tmp_path):
    """The training length comes from the checkpoint: stock fairseq-eval-lm with the scaling as a model
    override scores what kerple-eval-lm scores."""
    ours = eval_lm(data_bin, rotary_checkpoint, tmp_path, "--lengths", "256", "--rotary-scaling", "yarn")[256]
    proc = run_forked("fairseq-eval-lm", [data_bin, "--user-dir", "kerple_fairseq", "--path", rotary_checkpoint,
                                          "--gen-subset", "valid", "--tokens-per-sample", "256", "--context-window",
                                          "0", "--max-tokens", "4096", "--cpu", "--num-workers", "0", "--model-overrides",
                                          "{'rotary_scaling': 'yarn', 'rotary_scaling_length': 256}"], REPO)
    out = proc.stdout + proc.stderr
    stock = float(out.rsplit("Perplexity: ", 1)[1].split()[0])
    assert stock == pytest.approx(ours, rel=1e-3)


def test_analyses_scale_a_scaled_rotary_model_for_their_length(data_bin, tmp_path):
    """kerple-analyze's position-wise and receptive-field runs a model trained with --rotary-scaling ntk
    at their --length as kerple-eval-lm does: s = length / training length."""
    import argparse

    from kerple_fairseq.analysis.commands.shared import load_for_data
    from kerple_fairseq.evaluation.loading import rotary_embedding
    from kerple_fairseq.experiments.language_models import model_size_flags

    train_in_process(data_bin, tmp_path, 2, "--arch", "transformer_lm_rotary", "--rotary-scaling", "ntk",
                     *model_size_flags(layers=1, width=32, heads=4))
    args = argparse.Namespace(data=str(data_bin), length=256, cpu=True)
    model, _, train_length, _ = load_for_data(args, str(tmp_path / "checkpoint_last.pt"))
    assert rotary_embedding(model).scale_factor() == 256 / train_length == 4
