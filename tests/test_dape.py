"""DAPE's transformed logits against plain float64 loops (values and gradients), causality, and DAPE
with every kind of bias in the model on every decoding path."""

import pytest
import torch

from kerple_core.attention.methods.dape import DataAdaptiveLogits
from kerple_fairseq.errors import KernelConfigError

from helpers import tiny_model
from test_layer_biases import log_probs, method_id, tokens_of


def leaky(x):
    return x if x >= 0 else 0.01 * x


def dape_mlp_reference(p, scores, bias, b, i, j):
    """``S + B + Linear(W, H)(LeakyReLU(Linear(2H, W)([S_ij; B_ij])))`` of one visible cell."""
    heads = scores.shape[1]
    features = [scores[b, h, i, j] for h in range(heads)] + [bias[h, i, j] for h in range(heads)]
    width = p["g.net.0.weight"].shape[0]
    hidden = [leaky(p["g.net.0.bias"][k] + sum(p["g.net.0.weight"][k, c] * features[c] for c in range(2 * heads)))
              for k in range(width)]
    return [scores[b, h, i, j] + bias[h, i, j] + p["g.net.2.bias"][h]
            + sum(p["g.net.2.weight"][h, k] * hidden[k] for k in range(width)) for h in range(heads)]


def dape_conv_reference(p, scores, bias, b, i, j):
    """DAPE v2 at one visible cell: two convolutions of width k along the keys over the input with
    zeros at every cell the query may not see (the key axis taken as unbounded)."""
    heads, num_keys = scores.shape[1], scores.shape[3]
    w1, b1, w2, b2 = p["g.hidden.weight"], p["g.hidden.bias"], p["g.out.weight"], p["g.out.bias"]
    width, reach = w1.shape[0], w1.shape[3] // 2

    def feature(c, key):
        if not (0 <= key < num_keys) or not torch.isfinite(bias[0, i, key]):
            return 0.0
        return scores[b, c, i, key] if c < heads else bias[c - heads, i, key]

    def hidden(k, key):
        return leaky(b1[k] + sum(w1[k, c, 0, t + reach] * feature(c, key + t)
                                 for c in range(2 * heads) for t in range(-reach, reach + 1)))

    hiddens = {key: [hidden(k, key) for k in range(width)] for key in range(j - reach, j + reach + 1)}
    return [scores[b, h, i, j] + bias[h, i, j] + b2[h]
            + sum(w2[h, k, 0, t + reach] * hiddens[j + t][k] for k in range(width) for t in range(-reach, reach + 1))
            for h in range(heads)]


def causal_bias(heads, length, window=0, seed=0):
    """A random ``[H, T, T]`` bias, ``-inf`` at future keys and beyond a window."""
    g = torch.Generator().manual_seed(seed)
    bias = torch.randn(heads, length, length, dtype=torch.float64, generator=g)
    distance = torch.arange(length)[:, None] - torch.arange(length)[None, :]
    hidden = (distance < 0) | ((distance >= window) if window else torch.zeros_like(distance, dtype=torch.bool))
    return bias.masked_fill(hidden, float("-inf"))


@pytest.mark.parametrize("variant, reference", [("mlp", dape_mlp_reference), ("conv", dape_conv_reference)])
@pytest.mark.parametrize("window", [0, 3])
def test_transformed_logits_and_gradients_equal_the_formula_by_loops(variant, reference, window):
    torch.manual_seed(0)
    heads, length, batch = 2, 6, 2
    transform = DataAdaptiveLogits(heads, 0, dape=variant, dape_width=3, dape_kernel_size=3).double()
    scores = torch.randn(batch, heads, length, length, dtype=torch.float64, requires_grad=True)
    bias = causal_bias(heads, length, window).requires_grad_()
    logits = transform(None, scores, bias)
    visible = torch.isfinite(bias)
    assert torch.equal(torch.isinf(logits), (~visible).expand_as(logits)), "-inf exactly where hidden"
    p = {name: q.detach().clone().requires_grad_() for name, q in transform.named_parameters()}
    ref_scores, ref_bias = scores.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
    cotangent = torch.randn(logits.shape, dtype=torch.float64)
    ours, theirs = 0.0, 0.0
    for b in range(batch):
        for i in range(length):
            for j in range(length):
                if not visible[0, i, j]:
                    continue
                expected = reference(p, ref_scores, ref_bias, b, i, j)
                for h in range(heads):
                    assert abs(logits[b, h, i, j].item() - expected[h].item()) < 1e-12, (variant, b, h, i, j)
                    ours = ours + cotangent[b, h, i, j] * logits[b, h, i, j]
                    theirs = theirs + cotangent[b, h, i, j] * expected[h]
    ours.backward()
    theirs.backward()
    for name, q in transform.named_parameters():
        torch.testing.assert_close(q.grad, p[name].grad, rtol=1e-10, atol=1e-12, msg=name)
    torch.testing.assert_close(scores.grad, ref_scores.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(bias.grad.masked_fill(~visible, 0), ref_bias.grad.masked_fill(~visible, 0),
                               rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("variant", ["mlp", "conv"])
def test_hidden_cells_do_not_reach_visible_logits(variant):
    torch.manual_seed(1)
    transform = DataAdaptiveLogits(2, 0, dape=variant, dape_width=4, dape_kernel_size=5)
    scores = torch.randn(1, 2, 8, 8)
    bias = causal_bias(2, 8, window=4).float()
    hidden = ~torch.isfinite(bias)
    changed = scores.masked_fill(hidden, 1e3)  # the scores of future keys and keys beyond the window
    torch.testing.assert_close(transform(None, changed, bias), transform(None, scores, bias))


def test_options_are_checked():
    with pytest.raises(KernelConfigError, match="unknown --dape 'bogus'"):
        DataAdaptiveLogits(4, 0, dape="bogus")
    with pytest.raises(KernelConfigError, match="--dape-kernel-size must be odd"):
        DataAdaptiveLogits(4, 0, dape="conv", dape_kernel_size=4)
    with pytest.raises(KernelConfigError, match="--dape-width must be >= 1"):
        DataAdaptiveLogits(4, 0, dape="mlp", dape_width=0)


# ---------------------------------------------------------------- in the model

CASES = [  # (bias kernel, flags): DAPE over no bias, ALiBi, KERPLE-log, rotary, FIRE, FoX and a weight kernel
    ("none", ["--dape", "mlp"]), ("alibi", ["--dape", "mlp"]), ("kerple_log", ["--dape", "conv"]),
    ("none", ["--rotary-embeddings", "--dape", "conv"]), ("fire", ["--dape", "conv"]), ("fox", ["--dape", "mlp"]),
    ("kerple_bias_wht", ["--dape", "mlp"]),
]


@pytest.mark.parametrize("case", CASES, ids=method_id)
def test_dape_changes_what_the_model_computes_and_has_its_own_parameters_per_layer(case):
    kernel, flags = case
    torch.manual_seed(0)
    model = tiny_model(kernel, *flags).eval()
    without = tiny_model(kernel, *[f for f in flags if f not in ("--dape", "mlp", "conv")]).eval()
    without.load_state_dict(model.state_dict(), strict=False)
    tokens = tokens_of()
    assert (log_probs(model, tokens) - log_probs(without, tokens)).abs().max() > 1e-3
    keys = [k for k in model.state_dict() if ".score_transform." in k]
    assert {k.split(".")[2] for k in keys} == {"0", "1"}, keys
