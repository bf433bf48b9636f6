"""A kernel's per-distance values laid out as the causal bias of blocks of queries (the one layout
test every kernel goes through), windows composed with every kernel, incremental rows."""

import argparse

import pytest
import torch

import reference
from kerple_core.attention.blocks import QueryBlock, query_blocks
from kerple_core.attention.distance_bias import DistanceBias
from kerple_fairseq.errors import KernelConfigError
from kerple_core.kernels import KERNELS, build_kernel
from kerple_core.visibility import Visibility

WINDOW = 7  # the window kernel's --attn-window here
NAMES = sorted(KERNELS)


def distance_bias(name, heads=8, attention_window=0):
    torch.manual_seed(3)
    kernel = build_kernel(name, heads, argparse.Namespace(), head_dim=16)
    window = attention_window or (WINDOW if kernel.requires_window else 0)
    return DistanceBias(kernel, Visibility(window=window))


def laid_out(bias, block, kind="bias", num_distances=None):
    """A block's bias or weight; the call's per-distance values span ``num_distances`` (default:
    just the block's)."""
    view = bias.for_block(block, num_distances or block.offset + block.num_queries, shared=False)
    return (view.mask if kind == "bias" else view.weight)(torch.float32, "cpu")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("window", [0, 5])
def test_window_composes_with_every_kernel(name, window):
    """The laid-out bias of 40 queries is the kernel's float64 reference at ``i - j`` (``-inf``
    in the future and outside the window); each query sees exactly ``min(i + 1, w)`` keys."""
    bias = distance_bias(name, attention_window=window)
    mask = laid_out(bias, QueryBlock(0, 40, 0, 40, 0))
    bias_fn, _ = reference.reference_functions(bias.kernel, {})
    if bias.attention_window:
        bias_fn = reference.windowed(bias_fn, bias.attention_window)
    reference.assert_matches(mask, reference.bias_matrix(8, 40, bias_fn))
    if bias.attention_window:
        assert (torch.isfinite(mask).sum(-1) == torch.arange(1, 41).clamp(max=bias.attention_window)).all()
    if bias.kernel.has_weight:
        _, weight_fn = reference.reference_functions(bias.kernel, {})
        reference.assert_matches(laid_out(bias, QueryBlock(0, 40, 0, 40, 0), "weight"), reference.weight_matrix(8, 40, weight_fn))


@pytest.mark.parametrize("name", NAMES)
def test_incremental_rows_and_blocks_are_rows_of_the_full_bias(name):
    """Queries after a cache (one block at an offset) and the blocks of a long sequence lay out
    exactly the rows and columns of the full bias they cover (from the same per-distance values,
    as in a model: a call's blocks share one vector over its keys)."""
    bias = distance_bias(name)
    kinds = ["bias", "weight"] if bias.kernel.has_weight else ["bias"]
    for kind in kinds:
        full = laid_out(bias, QueryBlock(0, 40, 0, 40, 0), kind)
        for new in (1, 7):
            (block,) = query_blocks(new, 40)
            torch.testing.assert_close(laid_out(bias, block, kind, 40), full[:, -new:, :], rtol=0, atol=0)
        for block in query_blocks(40, 40, block_size=16, visibility=bias.visibility):
            torch.testing.assert_close(
                laid_out(bias, block, kind, 40),
                full[:, block.query_start:block.query_end, block.key_start:block.key_end], rtol=0, atol=0)


def test_shared_block_is_laid_out_once_per_forward_and_blocks_of_a_long_sequence_are_not_kept():
    bias = distance_bias("alibi")
    laid = []
    original = bias.per_distance
    bias.per_distance = lambda *a: laid.append(a) or original(*a)
    (block,) = query_blocks(30, 30)
    with bias.forward_scope():
        first = bias.for_block(block, 30, shared=True).mask(torch.float32, "cpu")
        assert bias.for_block(block, 30, shared=True).mask(torch.float32, "cpu") is first
        blocks = query_blocks(30, 30, block_size=8)
        masks = [bias.for_block(b, 30, shared=False).mask(torch.float32, "cpu") for b in blocks]
        assert masks[1] is not bias.for_block(blocks[1], 30, shared=False).mask(torch.float32, "cpu")
    assert len(laid) == 1, "the kernel is evaluated once per forward for every block"


@pytest.mark.parametrize("kernel", ["alibi", "kerple_log"])
def test_a_long_sequences_blocks_are_laid_out_once_for_every_layer_in_training_and_per_layer_in_evaluation(
        kernel, monkeypatch):
    """While autograd records, each layer's backward would keep its own laid-out blocks: one copy serves them
    all, and a learnable kernel's gradient gathers every layer's (equal to the gradient through one block of
    every query); otherwise a layer's blocks go once it is done."""
    from helpers import random_tokens, tiny_model
    from kerple_core.attention import distance_bias as module

    laid = []
    original = module.toeplitz
    monkeypatch.setattr(module, "toeplitz", lambda *a, **k: laid.append(a[1:3]) or original(*a, **k))
    tokens = random_tokens(batch=2, length=24)
    models, gradients, layouts = {}, {}, {}
    for block_size in ("8", "0"):
        torch.manual_seed(0)
        models[block_size] = model = tiny_model(kernel, "--decoder-layers", "3", "--attention-block-size", block_size,
                                                "--attention-backend", "sdpa").double().train()
        laid.clear()
        model(tokens)[0].sum().backward()
        gradients[block_size] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        layouts[block_size] = list(laid)
    blocks = [(b.num_queries, b.num_keys) for b in query_blocks(24, 24, block_size=8)]
    assert len(blocks) == 3 and layouts == {"8": blocks, "0": [(24, 24)]}
    assert gradients["8"].keys() == gradients["0"].keys()
    assert ("decoder.attention_bias.kernel.r1" in gradients["0"]) == (kernel == "kerple_log")
    for name, gradient in gradients["0"].items():
        torch.testing.assert_close(gradients["8"][name], gradient, rtol=1e-9, atol=1e-12, msg=name)
    laid.clear()
    with torch.no_grad():
        models["8"](tokens)
    assert laid == blocks * 3
    laid.clear()
    models["8"](tokens)
    assert laid == blocks, "autograd records: once for every layer"
    laid.clear()
    models["8"].requires_grad_(False)
    models["8"](tokens)
    assert laid == blocks * 3, "autograd on, nothing to record: per layer"


def test_window_needs_a_positive_window():
    with pytest.raises(KernelConfigError, match="--bias-kernel window needs --attn-window W > 0"):
        DistanceBias(build_kernel("window", 8))
    with pytest.raises(KernelConfigError, match="--attn-window must be >= 0"):
        DistanceBias(build_kernel("alibi", 8), Visibility(window=-1))


def test_frozen_values_are_kept_until_the_parameters_change_and_dropped_on_train_or_move():
    """While the kernel is frozen its per-distance values are built once and kept, keyed without reading
    the parameters (kerple_core/attention/frozen.py): an in-place write or load_state_dict builds them
    anew, equal to the kernel's values then; entering or leaving training and a cast drop them."""
    bias = distance_bias("kerple_log")
    bias.eval()

    def values():
        with torch.no_grad():
            return bias.distance_values("bias", 16, torch.float32, "cpu")

    first = values()
    assert values() is first, "kept while frozen"
    with torch.no_grad():
        next(bias.kernel.parameters()).add_(0.5)  # as an in-place write does
    written = values()
    assert written is not first
    torch.testing.assert_close(written, bias.per_distance(16).detach())
    state = {name: t + 0.25 for name, t in bias.state_dict().items()}
    bias.load_state_dict(state)
    loaded = values()
    assert loaded is not written
    torch.testing.assert_close(loaded, bias.per_distance(16).detach())
    assert values() is loaded
    for drop in (lambda: bias.train(), lambda: bias.eval(), lambda: bias.to(torch.float64)):
        kept = values()
        drop()
        assert values() is not kept
