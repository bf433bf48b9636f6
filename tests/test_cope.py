"""CoPE's positions and logits against plain float64 loops (values and gradients), in half precision
at long lengths, and its table in the model (its decoding paths: test_decoding_paths_of_newer_methods.py)."""

import math

import pytest
import torch

from kerple_core.attention.methods.cope import ContextualPositions
from kerple_fairseq.errors import KernelConfigError

from helpers import tiny_model
from test_dape import causal_bias
from test_layer_biases import log_probs, method_id, tokens_of


def cope_reference(table, q, scores, bias, b, h, i, j):
    """``S_ij + B_ij + q_i . e(p_ij)`` of one visible cell, ``p_ij = min(sum over visible t >= j of
    sigmoid(S_it), P - 1)``, ``e`` interpolated between the table's columns."""
    count = sum(torch.sigmoid(scores[b, h, i, t]) for t in range(j, scores.shape[3]) if math.isfinite(bias[h, i, t]))
    p = torch.clamp(count, max=table.shape[1] - 1)
    below, above = math.floor(p.item()), math.ceil(p.item())
    weight = p - below
    embedding = [weight * table[d, above] + (1 - weight) * table[d, below] for d in range(table.shape[0])]
    return scores[b, h, i, j] + bias[h, i, j] + sum(q[b, h, i, d] * embedding[d] for d in range(table.shape[0]))


@pytest.mark.parametrize("max_positions, window", [(40, 0), (40, 4), (3, 0)], ids=["unclipped", "window", "clipped"])
def test_logits_and_gradients_equal_the_formula_by_loops(max_positions, window):
    torch.manual_seed(0)
    batch, heads, length, dim = 2, 2, 9, 4
    cope = ContextualPositions(dim, max_positions).double()
    with torch.no_grad():
        cope.embeddings.normal_()
    q = torch.randn(batch, heads, length, dim, dtype=torch.float64, requires_grad=True)
    scores = (3 * torch.randn(batch, heads, length, length, dtype=torch.float64)).requires_grad_()
    bias = causal_bias(heads, length, window).requires_grad_()
    logits = cope(q, scores, bias)
    visible = torch.isfinite(bias).expand_as(logits)
    assert torch.isneginf(logits[~visible]).all()
    weights = torch.randn(logits.shape, dtype=torch.float64)
    (logits[visible] * weights[visible]).sum().backward()
    got = [cope.embeddings.grad, q.grad, scores.grad, bias.grad]

    table = cope.embeddings.detach().clone().requires_grad_()
    inputs = [table] + [x.detach().clone().requires_grad_() for x in (q, scores, bias)]
    total = 0.0
    clipped = False
    for b in range(batch):
        for h in range(heads):
            for i in range(length):
                for j in range(length):
                    if math.isfinite(bias[h, i, j].item()):
                        expected = cope_reference(*inputs, b, h, i, j)
                        assert abs(logits[b, h, i, j].item() - expected.item()) < 1e-12, (b, h, i, j)
                        total = total + weights[b, h, i, j] * expected
                        counted = cope.positions(scores, bias)[b, h, i, j].item()
                        clipped |= counted == max_positions - 1
    total.backward()
    for name, ours, reference in zip(["table", "q", "scores", "bias"], got, [x.grad for x in inputs]):
        torch.testing.assert_close(ours, reference, rtol=0, atol=1e-10, msg=name)
    assert clipped == (max_positions == 3), "the clipped case reaches the last position, the others do not"


def test_positions_count_the_gates_from_each_key_to_the_query():
    cope = ContextualPositions(2, 100)
    scores = torch.zeros(1, 1, 4, 4)  # every gate 1/2
    bias = causal_bias(1, 4).float()
    positions = cope.positions(scores, bias)[0, 0]
    expected = torch.tensor([[0.5, 0, 0, 0], [1.0, 0.5, 0, 0], [1.5, 1.0, 0.5, 0], [2.0, 1.5, 1.0, 0.5]])
    torch.testing.assert_close(positions, expected)


def test_half_precision_at_long_lengths_counts_in_float32():
    """Over 4096 keys a count in fp16 would be off by whole positions; here the logits stay finite and
    within half precision's rounding of the float64 ones."""
    torch.manual_seed(0)
    length, dim = 4096, 8
    cope = ContextualPositions(dim, 4097)
    with torch.no_grad():
        cope.embeddings.normal_()
    q = torch.randn(1, 1, 16, dim)
    scores = torch.randn(1, 1, 16, length) + 2.0  # most gates near 0.9: counts up to about 3600
    bias = torch.zeros(1, 16, length)
    exact = cope.double()(q.double(), scores.double(), bias.double())
    half = cope.half()(q.half(), scores.half(), bias.half())
    assert torch.isfinite(half).all()
    assert cope.positions(scores.half(), bias.half()).dtype == torch.float32
    torch.testing.assert_close(half.double(), exact, rtol=0, atol=0.02 * exact.abs().max().item())


CASES = [  # (bias kernel, flags): CoPE alone and over ALiBi, KERPLE-log, rotary, FIRE and a weight kernel
    ("none", ["--cope"]), ("alibi", ["--cope"]), ("kerple_log", ["--cope"]),
    ("none", ["--rotary-embeddings", "--cope"]), ("fire", ["--cope"]), ("kerple_bias_wht", ["--cope"]),
]


def cope_model(kernel, *flags):
    """A tiny model with CoPE whose tables are random (they start at zero, where CoPE adds nothing)."""
    model = tiny_model(kernel, *flags)
    with torch.no_grad():
        for layer in model.decoder.layers:
            layer.self_attn.score_transform.embeddings.normal_()
    return model


@pytest.mark.parametrize("case", CASES, ids=method_id)
def test_each_layer_has_a_table_that_starts_at_zero_and_changes_the_model(case):
    kernel, flags = case
    torch.manual_seed(0)
    model = tiny_model(kernel, *flags, "--tokens-per-sample", "16")
    state = model.state_dict()
    tables = [state[f"decoder.layers.{n}.self_attn.score_transform.embeddings"] for n in range(2)]
    assert all(t.shape == (8, 17) and not t.any() for t in tables)  # head dim 32 / 4, --tokens-per-sample + 1
    torch.manual_seed(0)
    randomised = cope_model(kernel, *flags)
    without = tiny_model(kernel, *[f for f in flags if f != "--cope"])
    without.load_state_dict({k: v for k, v in randomised.state_dict().items() if "score_transform" not in k})
    tokens = tokens_of()
    assert (log_probs(randomised.eval(), tokens) - log_probs(without.eval(), tokens)).abs().max() > 1e-3


def test_bad_cope_options_are_clear_errors():
    with pytest.raises(KernelConfigError, match="--cope and --dape each rewrite the attention logits; choose one"):
        tiny_model("alibi", "--cope", "--dape", "mlp")
    with pytest.raises(KernelConfigError, match="--cope-max-positions must be >= 2, got 1"):
        tiny_model("none", "--cope", "--cope-max-positions", "1")
