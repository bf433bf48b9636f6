"""p-RoPE (``--rotary-fraction p``): rotary on the pairs of the highest frequencies only, against a
plain float64 loop of the formula; ``p = 1`` is rotary and ``p = 0`` NoPE, bit for bit; decoding,
blocks and beam search equal full scoring; bad values are one-line errors."""

import pytest
import torch

from kerple_fairseq.errors import KernelConfigError

from helpers import tiny_model
from test_decoding_paths_of_newer_methods import beam_search_matches_full_scoring
from test_layer_biases import log_probs, tokens_of
from test_rotary_scaling import DIM, assert_logits_by_loops, rotary_with


@pytest.mark.parametrize("fraction, rotated", [(0.25, 2), (0.5, 4), (0.75, 6), (0.3, 2)])
def test_partial_rotary_logits_equal_the_formula_by_loops(fraction, rotated):
    """The first ``floor(p D / 2)`` pairs (``D = 16``: 8 pairs) rotate with ``10000^(-2k/D)``, the rest not."""
    frequencies = [10000.0 ** (-2.0 * k / DIM) if k < rotated else 0.0 for k in range(DIM // 2)]
    rotary = rotary_with(rotary_fraction=fraction)
    torch.testing.assert_close(rotary.inverse_frequencies(1.0), torch.tensor(frequencies, dtype=torch.float64),
                               rtol=0, atol=0)
    assert_logits_by_loops(rotary, frequencies)


def partial(fraction, *flags):
    return tiny_model("none", "--rotary-fraction", str(fraction), *flags, arch="transformer_lm_rotary")


def test_all_pairs_is_rotary_and_none_is_nope():
    torch.manual_seed(0)
    whole = partial(1.0).double().eval()
    rotary = tiny_model("none", arch="transformer_lm_rotary").double().eval()
    nope = tiny_model("none").double().eval()
    unrotated = partial(0.0).double().eval()
    for other in (rotary, nope, unrotated):
        other.load_state_dict(whole.state_dict())
    tokens = tokens_of()
    assert torch.equal(log_probs(whole, tokens), log_probs(rotary, tokens))
    assert torch.equal(log_probs(unrotated, tokens), log_probs(nope, tokens))
    half = partial(0.5).double().eval()
    half.load_state_dict(whole.state_dict())
    for other in (rotary, nope):
        assert (log_probs(half, tokens) - log_probs(other, tokens)).abs().max() > 1e-3


def test_incremental_decoding_blocks_and_beam_search_equal_full_scoring():
    torch.manual_seed(0)
    model = partial(0.5).double().eval()
    blocked = partial(0.5, "--attention-block-size", "4").double().eval()
    blocked.load_state_dict(model.state_dict())
    tokens = tokens_of()
    full = log_probs(model, tokens)
    assert (full - log_probs(model, tokens, incremental=True)).abs().max() < 1e-10
    torch.testing.assert_close(log_probs(blocked, tokens), full, rtol=0, atol=1e-10)
    beam_search_matches_full_scoring(partial(0.5).eval())


def test_bad_fractions_are_clear_errors():
    with pytest.raises(KernelConfigError, match=r"--rotary-fraction must be in \[0, 1\]"):
        partial(1.5)
    with pytest.raises(KernelConfigError, match="--rotary-fraction is for plain rotary models"):
        partial(0.5, "--rotary-xpos")
    with pytest.raises(KernelConfigError, match="--rotary-fraction changes rotary embeddings"):
        tiny_model("alibi", "--rotary-fraction", "0.5")
