"""Rotary position embeddings, applied to queries and keys inside self-attention."""

from typing import Tuple

import torch
from torch import Tensor, nn

from kerple_fairseq.errors import KernelConfigError

ROTARY_BASE = 10000.0
#: xPos's default scale base (its ``scale_base``)
XPOS_SCALE_BASE = 512.0


class RotaryEmbedding(nn.Module):
    """RoPE (Su et al., RoFormer, 2021, §3.4.2): rotate each pair of features of a
    query or key at position ``m`` by the angle ``m * theta_k``,
    ``theta_k = 10000^(-2k/D)``, so that ``q_m . k_n`` depends on ``m - n`` only.

    Features are paired as ``(x_k, x_{k + D/2})`` (the GPT-NeoX layout, which
    KERPLE's and Sandwich's rotary baselines use). Angles are computed in
    float64, their cosines and sines cast once to the activations' dtype. No
    parameters: checkpoints are unchanged by it.
    """

    def __init__(self, head_dim: int, xpos: bool = False, xpos_scale_base: float = XPOS_SCALE_BASE):
        super().__init__()
        if head_dim % 2:
            raise KernelConfigError(f"rotary embeddings need an even head dimension, got {head_dim}")
        if xpos_scale_base <= 0:
            raise KernelConfigError(f"--xpos-scale-base must be > 0, got {xpos_scale_base}")
        self.head_dim = head_dim
        self.xpos = xpos
        self.xpos_scale_base = float(xpos_scale_base)

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

    def xpos_zeta(self, device=None) -> Tensor:
        """``zeta_k = (2k + 0.4 D) / (1.4 D)`` of each pair ``k``, float64 ``[D/2]``."""
        k = torch.arange(self.head_dim // 2, dtype=torch.float64, device=device)
        return (2 * k + 0.4 * self.head_dim) / (1.4 * self.head_dim)

    def decay(self, q: Tensor, k: Tensor, first_query: int, first_key: int) -> Tuple[Tensor, Tensor]:
        """xPos's decay of one block of rotated queries ``[..., T, D]`` at absolute positions
        ``first_query ..`` and keys ``[..., S, D]`` at ``first_key ..``: pair ``k`` of the logit of
        query ``n`` and key ``m`` is multiplied by ``zeta_k^((n - m) / scale_base)`` (Sun et al., "A
        Length-Extrapolatable Transformer", 2023, §3.2). Unchanged without ``xpos``.

        The reference scales the query by ``zeta^(n / scale_base)`` and the key by
        ``zeta^(-m / scale_base)``, which overflow (keys) and underflow (queries) in fp16 at long
        positions. Both are measured here from the block's last query ``c`` instead:
        ``zeta^((n - c) / scale_base)`` (at most ``zeta_0^(-block / scale_base)``, 12 for a block of
        1024 queries) and ``zeta^((c - m) / scale_base)`` (at most 1); the product is the same. The
        cache keeps the keys before this scaling."""
        if not self.xpos:
            return q, k
        zeta = self.xpos_zeta(q.device)
        last_query = first_query + q.size(-2) - 1
        query_steps = torch.arange(first_query - last_query, 1, dtype=torch.float64, device=q.device)
        key_steps = torch.arange(last_query - first_key, last_query - first_key - k.size(-2), -1,
                                 dtype=torch.float64, device=q.device)

        def scales(steps: Tensor, dtype: torch.dtype) -> Tensor:
            per_pair = zeta[None, :] ** (steps[:, None] / self.xpos_scale_base)  # [T, D/2]
            return torch.cat([per_pair, per_pair], dim=-1).to(dtype)  # pairs (k, k + D/2)

        return q * scales(query_steps, q.dtype), k * scales(key_steps, k.dtype)

    def extra_repr(self) -> str:
        xpos = f", xpos (scale base {self.xpos_scale_base:g})" if self.xpos else ""
        return f"head_dim={self.head_dim}{xpos}"
