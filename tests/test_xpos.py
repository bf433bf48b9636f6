"""xPos: rotary with a per-pair decay, against plain float64 loops of its formula, finite in fp16 at
16k positions, and on every decoding path."""

import math

import pytest
import torch

from kerple_fairseq.errors import KernelConfigError

from helpers import tiny_model
from test_decoding_paths_of_newer_methods import beam_search_matches_full_scoring
from test_layer_biases import log_probs, tokens_of
from test_rotary_scaling import rotary_with

XPOS = ["--rotary-xpos"]


def xpos_logit_reference(q, k, n, m, scale_base=512.0):
    """``sum_k`` over pairs ``(k, k + D/2)``: the rotated query at ``n`` scaled by ``zeta_k^(n / scale_base)``
    dotted with the rotated key at ``m`` scaled by ``zeta_k^(-m / scale_base)``, scalar by scalar."""
    dim = len(q)
    half = dim // 2
    total = 0.0
    for pair in range(half):
        theta = 10000.0 ** (-2.0 * pair / dim)
        zeta = (2 * pair + 0.4 * dim) / (1.4 * dim)

        def rotated(x, position):
            a, b = x[pair], x[pair + half]
            angle = position * theta
            return a * math.cos(angle) - b * math.sin(angle), a * math.sin(angle) + b * math.cos(angle)

        qa, qb = rotated(q, n)
        ka, kb = rotated(k, m)
        total += (qa * ka + qb * kb) * zeta ** (n / scale_base) * zeta ** (-m / scale_base)
    return total


@pytest.mark.parametrize("first_query, num_queries, first_key, num_keys", [
    (0, 12, 0, 12), (1500, 4, 1000, 504), (2047, 1, 0, 2048)])
def test_decayed_logits_equal_the_formula_by_loops(first_query, num_queries, first_key, num_keys):
    torch.manual_seed(0)
    rotary = rotary_with(8, rotary_xpos=True)
    q = torch.randn(num_queries, 8, dtype=torch.float64)
    k = torch.randn(num_keys, 8, dtype=torch.float64)
    (q_rot,) = rotary(q, offset=first_query)
    (k_rot,) = rotary(k, offset=first_key)
    q_dec, k_dec = rotary.per_block(q_rot, k_rot, first_query, first_key)
    logits = q_dec @ k_dec.T
    for t in range(num_queries):
        for s in range(0, num_keys, max(1, num_keys // 40)):
            n, m = first_query + t, first_key + s
            expected = xpos_logit_reference(q[t].tolist(), k[s].tolist(), n, m)
            assert abs(logits[t, s].item() - expected) < 1e-9 * max(1.0, abs(expected)), (n, m)


def test_decay_is_finite_and_accurate_in_fp16_at_16k_positions():
    torch.manual_seed(1)
    rotary = rotary_with(32, rotary_xpos=True)
    q, k = torch.randn(1024, 32, dtype=torch.float64), torch.randn(16384, 32, dtype=torch.float64)
    (q,), (k,) = rotary(q, offset=15360), rotary(k, offset=0)
    q_exact, k_exact = rotary.per_block(q, k, 15360, 0)
    exact = q_exact @ k_exact.T
    q16, k16 = rotary.per_block(q.half(), k.half(), 15360, 0)
    assert torch.isfinite(q16).all() and torch.isfinite(k16).all()
    half = (q16.float() @ k16.float().T).double()
    assert (half - exact).abs().max() < 0.05 * exact.abs().max()


def test_without_xpos_a_block_is_unchanged():
    q, k = torch.randn(3, 8), torch.randn(5, 8)
    rotary = rotary_with(8)
    assert all(a is b for a, b in zip(rotary.per_block(q, k, 2, 0), (q, k)))


def test_xpos_needs_rotary_and_a_positive_scale_base():
    with pytest.raises(KernelConfigError, match="--rotary-xpos changes rotary embeddings"):
        tiny_model("none", "--rotary-xpos")
    with pytest.raises(KernelConfigError, match="--xpos-scale-base must be > 0"):
        tiny_model("none", "--rotary-embeddings", "--rotary-xpos", "--xpos-scale-base", "0")


@pytest.mark.parametrize("flags", [[], ["--attention-block-size", "4"], ["--attn-window", "7"]])
def test_incremental_decoding_and_blocks_equal_full_scoring(flags):
    torch.manual_seed(0)
    model = tiny_model("none", *XPOS, *flags, arch="transformer_lm_rotary").double().eval()
    one = tiny_model("none", *XPOS, "--attention-block-size", "0", arch="transformer_lm_rotary").double().eval()
    tokens = tokens_of()
    full = log_probs(model, tokens)
    assert (full - log_probs(model, tokens, incremental=True)).abs().max() < 1e-6
    if "--attn-window" not in flags:
        one.load_state_dict(model.state_dict())
        torch.testing.assert_close(full, log_probs(one, tokens), rtol=0, atol=1e-6)


def test_trimmed_cache_equals_the_window_and_beam_search_equals_full_scoring():
    torch.manual_seed(0)
    trimmed = tiny_model("none", *XPOS, "--max-cache-window", "6", arch="transformer_lm_rotary").double().eval()
    windowed = tiny_model("none", *XPOS, "--attn-window", "6", arch="transformer_lm_rotary").double().eval()
    windowed.load_state_dict(trimmed.state_dict())
    tokens = tokens_of()
    torch.testing.assert_close(log_probs(trimmed, tokens, incremental=True), log_probs(windowed, tokens),
                               rtol=0, atol=1e-6)
    beam_search_matches_full_scoring(tiny_model("none", *XPOS, arch="transformer_lm_rotary").eval())


def test_xpos_changes_what_rotary_computes():
    torch.manual_seed(0)
    xpos = tiny_model("none", *XPOS, "--xpos-scale-base", "8", arch="transformer_lm_rotary").eval()
    rotary = tiny_model("none", arch="transformer_lm_rotary").eval()
    rotary.load_state_dict(xpos.state_dict())
    tokens = tokens_of()
    assert (log_probs(xpos, tokens) - log_probs(rotary, tokens)).abs().max() > 1e-3
