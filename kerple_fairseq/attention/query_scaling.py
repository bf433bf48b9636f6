"""Factors on each query that depend on its position: scalable softmax and Llama 4's attention
temperature. Both multiply the (rotated) queries, so the logits ``q . k`` scale and a positional
bias added to them does not; every backend then serves them unchanged."""

import math
from typing import Optional

import torch
from torch import Tensor, nn

from kerple_fairseq.errors import KernelConfigError

#: the scale's initial value: the one an implementation of the paper reports from it (the paper's
#: own code is not public); --ssmax-scale-init changes it
SSMAX_SCALE_INIT = 0.43
#: Llama 4's ``floor_scale`` and ``attn_scale`` (transformers' ``Llama4TextConfig``)
TEMPERATURE_FLOOR_SCALE, TEMPERATURE_SCALE = 8192, 0.1


def visible_keys(first_position: int, num_queries: int, window: int, device) -> Tensor:
    """float64 ``[queries]``: the number of keys each query attends to, itself included: ``i + 1`` at
    absolute position ``i``, at most ``window`` (0: no window)."""
    counts = torch.arange(first_position + 1, first_position + num_queries + 1, dtype=torch.float64, device=device)
    return counts.clamp(max=window) if window else counts


class ScalableSoftmax(nn.Module):
    """Scalable softmax, SSMax (Nakanishi, "Scalable-Softmax Is Superior for Attention", 2025, §3):
    the logits of a query that attends to ``n`` keys are multiplied by ``s_h * log(n)``, so that its
    largest weight does not fade as ``n`` grows; ``s_h`` is learned, one per head of each layer.
    Here ``n = min(i + 1, window)`` for the query at position ``i``, and the factor multiplies the
    query (:mod:`kerple_fairseq.attention.query_scaling`)."""

    def __init__(self, num_heads: int, scale_init: float = SSMAX_SCALE_INIT):
        super().__init__()
        if not math.isfinite(scale_init):
            raise KernelConfigError(f"--ssmax-scale-init must be a finite number, got {scale_init}")
        self.scale = nn.Parameter(torch.full((num_heads,), float(scale_init)))

    def forward(self, q: Tensor, first_position: int, window: int) -> Tensor:
        """``q`` ``[B, H, T, D]`` at positions ``first_position ..``, each times ``s_h log(n)``."""
        log_n = visible_keys(first_position, q.size(2), window, q.device).log().to(q.dtype)
        return q * (self.scale.to(q.dtype)[:, None, None] * log_n[:, None])

    def extra_repr(self) -> str:
        return f"heads={self.scale.numel()}"


class AttentionTemperature(nn.Module):
    """Llama 4's attention temperature tuning (Meta, 2025; transformers' ``Llama4TextAttention``): the
    query at position ``i`` is multiplied by ``1 + beta * log(floor((i + 1) / F) + 1)``, 1 before
    position ``F - 1``, growing with the log of the length beyond it. An inference-time factor with
    no parameters, usable on any trained model."""

    def __init__(self, floor_scale: int = TEMPERATURE_FLOOR_SCALE, scale: float = TEMPERATURE_SCALE):
        super().__init__()
        if floor_scale < 1:
            raise KernelConfigError(f"--attn-temperature-floor-scale must be >= 1, got {floor_scale}")
        if not math.isfinite(scale):
            raise KernelConfigError(f"--attn-temperature-scale must be a finite number, got {scale}")
        self.floor_scale, self.beta = floor_scale, float(scale)

    def forward(self, q: Tensor, first_position: int, window: int) -> Tensor:
        positions = torch.arange(first_position, first_position + q.size(2), dtype=torch.float64, device=q.device)
        factor = 1.0 + self.beta * torch.log(torch.floor((positions + 1) / self.floor_scale) + 1)
        return q * factor.to(q.dtype)[:, None]

    def extra_repr(self) -> str:
        return f"floor_scale={self.floor_scale}, scale={self.beta:g}"


def query_scales(num_heads: int, ssmax: bool = False, ssmax_scale_init: float = SSMAX_SCALE_INIT,
                 temperature: bool = False, floor_scale: int = TEMPERATURE_FLOOR_SCALE,
                 temperature_scale: float = TEMPERATURE_SCALE) -> Optional[nn.ModuleList]:
    """One layer's query scales, applied in this order (None: neither)."""
    scales = ([ScalableSoftmax(num_heads, ssmax_scale_init)] if ssmax else []) + \
        ([AttentionTemperature(floor_scale, temperature_scale)] if temperature else [])
    return nn.ModuleList(scales) if scales else None
