"""Rotary position embeddings, applied to queries and keys inside self-attention."""

from typing import Tuple

import torch
from torch import Tensor, nn

from kerple_fairseq.errors import KernelConfigError

ROTARY_BASE = 10000.0


class RotaryEmbedding(nn.Module):
    """RoPE (Su et al., RoFormer, 2021, §3.4.2): rotate each pair of features of a
    query or key at position ``m`` by the angle ``m * theta_k``,
    ``theta_k = 10000^(-2k/D)``, so that ``q_m . k_n`` depends on ``m - n`` only.

    Features are paired as ``(x_k, x_{k + D/2})`` (the GPT-NeoX layout, which
    KERPLE's and Sandwich's rotary baselines use). Angles are computed in
    float64, their cosines and sines cast once to the activations' dtype. No
    parameters: checkpoints are unchanged by it.
    """

    def __init__(self, head_dim: int):
        super().__init__()
        if head_dim % 2:
            raise KernelConfigError(f"rotary embeddings need an even head dimension, got {head_dim}")
        self.head_dim = head_dim

    def forward(self, *xs: Tensor, offset: int = 0) -> Tuple[Tensor, ...]:
        """Rotate each ``x`` (``[..., T, head_dim]``, e.g. queries and keys), whose rows sit at
        positions ``offset .. offset + T - 1``; the angles are computed once for all of them."""
        x0, half = xs[0], self.head_dim // 2
        k = torch.arange(half, dtype=torch.float64, device=x0.device)
        positions = torch.arange(offset, offset + x0.size(-2), dtype=torch.float64, device=x0.device)
        angles = positions[:, None] * ROTARY_BASE ** (-2.0 * k / self.head_dim)[None, :]  # [T, D/2]
        cos, sin = angles.cos().to(x0.dtype), angles.sin().to(x0.dtype)

        def rotate(x: Tensor) -> Tensor:
            first, second = x[..., :half], x[..., half:]
            return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)

        return tuple(rotate(x) for x in xs)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}"
