"""Learnable kernels' gradient through fused forwards (CPU): the same gradient as autograd through
the ``L x L`` bias, for every kernel with per-head parameters, windows, blocks and dead rows."""

import math
from argparse import Namespace

import pytest
import torch
import torch.nn.functional as F

from helpers import VOCAB, tiny_model
from kerple_core.attention import kernel_gradient
from kerple_core.attention.attend import choose_backend
from kerple_core.attention.blocks import QueryBlock
from kerple_core.attention.distance_bias import DistanceBias, toeplitz
from kerple_core.attention.kernel_gradient import attend_with_kernel_gradient, rows_seeing_a_key
from kerple_core.kernels import KERNELS, BiasKernel, build_kernel
from kerple_core.visibility import Visibility
from test_attention_blocks import REFERENCE, loss_and_gradients, pair

PER_HEAD = sorted(name for name, cls in KERNELS.items() if cls.per_head_parameters)
FUSABLE = [name for name in PER_HEAD if not KERNELS[name].has_weight]


class SineKernel(BiasKernel):
    """``B_h(d) = a_h sin(d) + c_h d``: tangents of both signs (``sin``) and of one (``d``)."""

    name = "sine"
    per_head_parameters = True

    def __init__(self, num_heads):
        super().__init__(num_heads)
        self.a = torch.nn.Parameter(torch.randn(num_heads, dtype=torch.float64))
        self.c = torch.nn.Parameter(-torch.rand(num_heads, dtype=torch.float64))

    def forward(self, distance):
        return self.a[:, None] * distance.to(self.a.dtype).sin() + self.c[:, None] * distance.to(self.a.dtype)


def kernel_options():
    return Namespace(alibi_rf_learnable_rho=True, bam_loc_trainable=True, decoder_embed_dim=64)  # every option learned


def test_the_kernels_with_per_head_parameters_are_the_learnable_ones():
    assert {"kerple_log", "kerple_log3", "kerple_power", "gauss_bias2", "gauss_bias3", "alibi_rf"} <= set(FUSABLE)
    assert "t5" not in PER_HEAD and "alibi" not in PER_HEAD


@pytest.mark.parametrize("name", PER_HEAD)
@pytest.mark.parametrize("window", [0, 6])
def test_tangents_are_the_per_head_jacobian(name, window):
    """Element h of every parameter moves head h's bias alone, and ``tangents`` is that derivative."""
    torch.manual_seed(0)
    kernel = build_kernel(name, 4, kernel_options()).double()
    bias = DistanceBias(kernel, Visibility(window=window))
    distances = 20
    tangents = bias.tangents(distances)
    parameters = list(kernel.parameters())
    assert tangents.shape == (len(parameters), 4, distances) and parameters
    for index, parameter in enumerate(parameters):
        def line(value, index=index):
            values = [p.detach() for p in parameters]
            values[index] = value
            names = [n for n, _ in kernel.named_parameters()]
            return bias._windowed(torch.func.functional_call(kernel, dict(zip(names, values)),
                                                             (torch.arange(distances, dtype=torch.float64),)),
                                  torch.arange(distances))
        jacobian = torch.autograd.functional.jacobian(line, parameter.detach())  # [H, D, H]
        jacobian = torch.nan_to_num(jacobian, posinf=0.0, neginf=0.0)
        for h in range(4):
            others = [g for g in range(4) if g != h]
            assert torch.all(jacobian[h][:, others] == 0), f"head {h}'s bias moves with another head's {index}"
            torch.testing.assert_close(tangents[index, h], jacobian[h, :, h], rtol=1e-10, atol=1e-12)
        if window:
            assert torch.all(tangents[index, :, window:] == 0)


@pytest.mark.parametrize("query_len,key_len,offset", [(1, 1, 0), (5, 5, 0), (4, 9, 5), (3, 12, 2), (6, 6, 10)])
@pytest.mark.parametrize("window", [0, 1, 3])
def test_rows_seeing_a_key_match_the_laid_out_rows(query_len, key_len, offset, window):
    g = torch.Generator().manual_seed(query_len * 100 + key_len + offset)
    line = torch.randn(3, offset + query_len, generator=g)
    line[torch.rand(line.shape, generator=g) < 0.4] = float("-inf")
    if window:
        line[:, window:] = float("-inf")
    laid_out = toeplitz(line, query_len, key_len, float("-inf"), torch.float32, offset=offset)
    assert torch.equal(rows_seeing_a_key(line, query_len, key_len, offset), torch.isfinite(laid_out).any(-1))


def block_bias(bias, query_len, key_len, offset):
    """The bias view of one block: queries ``offset ..`` positions after its first key."""
    return bias.for_block(QueryBlock(0, query_len, 0, key_len, offset), offset + query_len, shared=False)


def attention_gradients(bias, q, k, v, offset, fused):
    """Output and gradients of q, k, v and every kernel parameter: through the kernel gradient
    backend (``fused``) or autograd through the laid-out bias and an explicit softmax."""
    parameters = list(bias.kernel.parameters())
    for tensor in [q, k, v, *parameters]:
        tensor.grad = None
    query_len, key_len = q.size(2), k.size(2)
    with bias.forward_scope():
        view = block_bias(bias, query_len, key_len, offset)
        if fused:
            out = attend_with_kernel_gradient(q, k, v, view)
        else:
            mask = toeplitz(bias.per_distance(offset + query_len), query_len, key_len, float("-inf"), q.dtype,
                            offset=offset)[None]
            out = torch.softmax(q @ k.transpose(-1, -2) + mask, dim=-1).nan_to_num() @ v
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=out.dtype)
    out.backward(grad_out)
    return out.detach(), [t.grad.clone() for t in [q, k, v, *parameters]]


@pytest.mark.parametrize("kernel_name", ["sine", *FUSABLE])
@pytest.mark.parametrize("window", [0, 1, 4])
@pytest.mark.parametrize("query_len,key_len,offset", [(12, 12, 0), (5, 13, 8), (7, 10, 3)])
def test_fused_gradient_equals_autograd_through_the_bias(kernel_name, window, query_len, key_len, offset):
    """float64, blocks of queries against earlier keys included; rows left without keys (window 1,
    where a tangent vanishes at distance 0) and tangents of both signs (``sine``)."""
    torch.manual_seed(1)
    kernel = SineKernel(4) if kernel_name == "sine" else build_kernel(kernel_name, 4, kernel_options()).double()
    with torch.no_grad():
        for p in kernel.parameters():
            p.add_(0.3 * torch.randn_like(p))
    bias = DistanceBias(kernel, Visibility(window=window))
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 4, n, 8, generator=g, dtype=torch.float64, requires_grad=True)
               for n in (query_len, key_len, key_len))
    out, grads = attention_gradients(bias, q, k, v, offset, fused=True)
    expected_out, expected_grads = attention_gradients(bias, q, k, v, offset, fused=False)
    torch.testing.assert_close(out, expected_out, rtol=0, atol=1e-12)
    for got, expected, name in zip(grads, expected_grads, ["q", "k", "v"] + [n for n, _ in kernel.named_parameters()]):
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-11, msg=name)


def count_fused_gradients(monkeypatch):
    calls = []
    original = kernel_gradient._AttentionWithKernelGradient.apply
    monkeypatch.setattr(kernel_gradient._AttentionWithKernelGradient, "apply",
                        lambda *a: calls.append(a[0].shape) or original(*a))
    return calls


@pytest.mark.parametrize("kernel,flags", [
    ("kerple_log", []), ("kerple_log3", ["--attn-window", "9"]), ("kerple_power", []), ("gauss_bias2", []),
    ("alibi_rf", ["--alibi-rf-learnable-rho"]), ("kerple_log", ["--attn-window", "1"]),
])
@pytest.mark.parametrize("blocks", [False, True])
def test_models_train_through_the_fused_gradient_with_the_reference_gradients(kernel, flags, blocks, monkeypatch):
    """Whole float64 models (every parameter's gradient) against one explicit L x L softmax."""
    reference, model = pair(kernel, flags, ["--attention-block-size", "16" if blocks else "0"])
    monkeypatch.setattr(kernel_gradient, "MIN_KEYS", 0)
    calls = count_fused_gradients(monkeypatch)
    g = torch.Generator().manual_seed(3)
    tokens, targets = (torch.randint(4, VOCAB + 4, (2, 70), generator=g) for _ in range(2))
    out, grads = loss_and_gradients(model, tokens, targets)
    layers = len(model.decoder.layers)
    assert len(calls) == layers * (math.ceil(70 / model.decoder.setup.block_size_now()) if blocks else 1)
    expected_out, expected_grads = loss_and_gradients(reference, tokens, targets)
    torch.testing.assert_close(out, expected_out, rtol=0, atol=1e-6)
    scale = max(grad.abs().max().item() for grad in expected_grads.values())
    assert grads.keys() == expected_grads.keys() and any("attention_bias" in n for n in grads)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=1e-6 * scale, msg=name)


def test_float32_gradient_is_close_to_float64(monkeypatch):
    monkeypatch.setattr(kernel_gradient, "MIN_KEYS", 0)
    torch.manual_seed(0)
    model = tiny_model("kerple_log", *REFERENCE[:2]).train()
    reference = tiny_model("kerple_log", *REFERENCE).train().double()
    reference.load_state_dict(model.state_dict())
    tokens = torch.randint(4, VOCAB + 4, (2, 200))
    _, grads = loss_and_gradients(model, tokens, tokens)
    _, expected = loss_and_gradients(reference, tokens, tokens)
    for name in (n for n in expected if "attention_bias" in n):
        torch.testing.assert_close(grads[name].double(), expected[name], rtol=1e-3, atol=1e-6, msg=name)


def test_when_the_fused_gradient_applies():
    bias = DistanceBias(build_kernel("kerple_log", 4, kernel_options()))
    q = torch.zeros(1, 4, 600, 8)

    def backend(q, k, dropout=0.0, source=bias, **options):
        view = block_bias(source, q.size(2), k.size(2), k.size(2) - q.size(2))
        settings = dict(preference="auto", dropout=dropout, key_padding_mask=None, need_probabilities=False)
        return choose_backend(q, k, view, **{**settings, **options})

    assert backend(q, q) == "kernel gradient"
    assert backend(q[:, :, :100], q[:, :, :100]) == "sdpa", "too few keys to pay"
    assert backend(q, q, dropout=0.1) == "sdpa", "attention dropout: the probabilities are random"
    assert backend(q.half(), q.half()) == "sdpa"
    with torch.no_grad():
        assert backend(q, q, preference="sdpa") == "sdpa", "nothing to differentiate (evaluation)"
    assert backend(q, q, preference="explicit") == "explicit"
    assert backend(q, q, need_probabilities=True) == "explicit"
    assert backend(q, q, key_padding_mask=torch.zeros(1, 600, dtype=torch.bool)) == "explicit"
    for name in ("t5", "alibi"):  # no per-head parameters / no parameters
        assert backend(q, q, source=DistanceBias(build_kernel(name, 4, kernel_options()))) == "sdpa", name
    assert backend(q, q, source=DistanceBias(build_kernel("kerple_bias_wht", 4, kernel_options()))) == "explicit"


def test_dropout_falls_back_to_scaled_dot_product_attention(monkeypatch):
    calls = count_fused_gradients(monkeypatch)
    monkeypatch.setattr(kernel_gradient, "MIN_KEYS", 0)
    model = tiny_model("kerple_log", "--attention-dropout", "0.1").train()
    tokens = torch.randint(4, VOCAB + 4, (2, 40))
    logits, _ = model(tokens)
    F.cross_entropy(logits.view(-1, logits.size(-1)), tokens.view(-1)).backward()
    assert calls == []
    assert all(torch.isfinite(p.grad).all() for p in model.decoder.attention_bias.parameters())
