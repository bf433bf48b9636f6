"""The flex backend: FlexAttention (:mod:`kerple_core.attention.flex`) with the bias read inside the kernel from its
per-distance values (and a layer's own term), added in float32, never laid out; on CUDA in training and evaluation
(not with attention dropout, which it lacks), on CPU without gradients."""

from typing import Optional, Tuple

import torch
from torch import Tensor

from kerple_core.attention import flex
from kerple_core.attention.backends.base import AttentionBackend, AttentionCall, register_backend

#: fewest keys from which ``auto`` uses compiled FlexAttention on CPU: whole-model evaluation
#: (scripts/benchmark.py, 2 cores) measured it even with sdpa at 2048 keys and 0.2-0.25x of ``none``'s
#: time ahead at 8192
MIN_KEYS_CPU = 4096
#: smallest head dimension FlexAttention's CUDA kernels take (PyTorch 2.11: "NYI: embedding dimension of
#: the query, key, and value must be at least 16", measured on an H200)
MIN_HEAD_DIM_CUDA = 16


def serves(q: Tensor, bias, dropout: float, key_padding_mask: Optional[Tensor]) -> bool:
    """FlexAttention can attend the block (every bias has a score modification): a dtype it takes (not float64), no
    attention dropout; on CUDA, heads of at least :data:`MIN_HEAD_DIM_CUDA` dimensions, and a term beside the
    kernel's that reads the model's tensors (a layer's parameters or state, SSMax's row factors) only without
    gradients (PyTorch 2.11 compiles no backward for FoX's term, which indexes its cumulative gates twice, nor for
    FIRE's: measured on an H200, the first NotImplementedError, the second a FakeTensor assertion; through chunked
    attention's mask of positions it does: measured on an H100); on CPU, no gradient (it has no CPU backward) and,
    compiled, neither key padding nor a layer's own bias (PyTorch 2.13's CPU compiler fails on terms that read the
    batch index, as padding and FoX do, and on FIRE's)."""
    if not (flex.available() and dropout == 0.0 and q.dtype in flex.DTYPES):
        return False
    if q.device.type == "cuda":
        return q.size(-1) >= MIN_HEAD_DIM_CUDA and not (torch.is_grad_enabled() and bias.term_reads_model_tensors)
    return (q.device.type == "cpu" and not torch.is_grad_enabled()
            and (not flex.COMPILED or (key_padding_mask is None and not bias.has_layer_term)))


@register_backend("flex")
class FlexBackend(AttentionBackend):
    """Taken by ``auto`` where it serves on CUDA, and on CPU from :data:`MIN_KEYS_CPU` keys; not where a backend
    tried after it was asked for."""

    summary = ("FlexAttention, the bias read inside its kernel (on CPU only without gradients), taken on CUDA and "
               f"on CPU from {MIN_KEYS_CPU} keys")

    def takes(self, call: AttentionCall) -> bool:
        return (call.returns_values_only and not call.asked_for_a_later_backend(self)
                and serves(call.q, call.bias, call.dropout, call.key_padding_mask)
                and (call.asked is self or call.q.device.type == "cuda" or call.k.size(2) >= MIN_KEYS_CPU))

    def attend(self, call: AttentionCall) -> Tuple[Tensor, Optional[Tensor]]:
        padding = None if call.key_padding_mask is None else call.key_padding_mask.to(torch.bool)
        bias = call.bias
        return flex.attend(call.q, call.k, call.v, bias.score_mod(call.q.dtype, call.q.device),
                           bias.block_mask(call.q.device, padding)), None
