"""The sdpa backend: PyTorch's ``scaled_dot_product_attention`` with the block's bias as a 4-D additive mask
(its fused kernels on CPU and CUDA), attention dropout included. It serves blocks without key padding or a weight
kernel whose values alone are needed."""

import contextlib
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from kerple_core.attention.backends.base import AttentionBackend, AttentionCall, register_backend


def masked_sdpa_backends(dtype: torch.dtype) -> List[SDPBackend]:
    """SDPA's backends for a masked call on CUDA (flash takes no mask). Never cuDNN, whose query gradient
    is NaN with a mask when L % 128 == 64 and a row's log-sum-exp is below about -88.7 (PyTorch issue
    196678, torch 2.11-2.13). In float32 the math backend alone: the memory-efficient kernel's float32
    gradients missed the float64 reference by 7-10x the tolerance the other paths meet (a tiny
    ``gauss_bias3`` model, torch 2.11 on an H100 and an H200, TF32 off; the same with the mask detached,
    laid out per sequence, stored aligned, and at 320 and 336 tokens), while the math backend, the
    explicit path and FlexAttention met it."""
    if dtype == torch.float32:
        return [SDPBackend.MATH]
    return [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@register_backend("sdpa")
class SdpaBackend(AttentionBackend):
    summary = ("PyTorch's scaled_dot_product_attention with the bias laid out as a mask, taken where none before it "
               "is, without key padding or a weight kernel")

    def takes(self, call: AttentionCall) -> bool:
        """Where it serves: only the values needed, no key padding, no weight kernel."""
        return call.through_a_mask

    def attend(self, call: AttentionCall) -> Tuple[Tensor, Optional[Tensor]]:
        q = call.q
        mask = call.bias.mask(q.dtype, q.device)
        mask = mask if mask.dim() == 4 else mask[None]
        with sdpa_kernel(masked_sdpa_backends(q.dtype)) if q.device.type == "cuda" else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, call.k, call.v, attn_mask=mask, dropout_p=call.dropout,
                                                  scale=1.0), None
