"""RoPE's rotation (Su et al., RoFormer, 2021, §3.4.2): each pair of features of a query or key at
position ``m`` turned by the angle ``m * theta_k``, ``theta_k = b^(-2k/D)`` with the base ``b = 10000``,
so that ``q_m . k_n`` depends on ``m - n`` only.

Features are paired as ``(x_k, x_{k + D/2})`` (the GPT-NeoX layout, which KERPLE's and Sandwich's rotary
baselines use). Angles are computed in float64, their cosines and sines cast once to the activations' dtype.
"""

import torch
from torch import Tensor

ROTARY_BASE = 10000.0


def frequencies(head_dim: int, base: float = ROTARY_BASE, device=None) -> Tensor:
    """``theta_k = base^(-2k/D)`` of each pair ``k``, float64 ``[D/2]``."""
    k = torch.arange(head_dim // 2, dtype=torch.float64, device=device)
    return base ** (-2.0 * k / head_dim)


def rotate(x: Tensor, offset: float, theta: Tensor, magnitude: float = 1.0) -> Tensor:
    """``x`` ``[..., T, D]`` at positions ``offset ..``, each pair ``k`` turned by ``position * theta[k]``
    and scaled by ``magnitude``."""
    positions = torch.arange(x.size(-2), dtype=torch.float64, device=x.device) + offset
    return turn(x, positions[:, None] * theta[None, :], magnitude)


def turn(x: Tensor, angles: Tensor, magnitude: float = 1.0) -> Tensor:
    """``x`` ``[..., T, D]`` with pair ``k`` of row ``t`` turned by ``angles[t, k]`` (float64) and scaled by
    ``magnitude``."""
    half = x.size(-1) // 2
    cos, sin = (angles.cos() * magnitude).to(x.dtype), (angles.sin() * magnitude).to(x.dtype)
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)
