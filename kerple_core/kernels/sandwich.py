"""Sandwich: the inner product of sinusoidal embeddings as a parameter-free bias."""

from dataclasses import dataclass, field
from typing import List, Tuple

import torch
from torch import Tensor

from kerple_core.errors import KernelConfigError
from kerple_core.kernels.base import BiasKernel, per_head_column
from kerple_core.kernels.registry import register_kernel

SINUSOID_BASE = 10000.0


@dataclass
class SandwichOptions:
    sandwich_dim: int = field(
        default=128,
        metadata={"help": "sandwich: dimension D of the sinusoidal embeddings whose inner product is "
                  "the bias (even, >= 2; the paper's d-bar)"},
    )


def check_dim(sandwich_dim: int) -> int:
    if sandwich_dim < 2 or sandwich_dim % 2:
        raise KernelConfigError(f"--sandwich-dim must be an even number >= 2, got {sandwich_dim}")
    return sandwich_dim


def sandwich_curves(num_heads: int, sandwich_dim: int, distance: Tensor) -> Tensor:
    """``[num_heads, n]`` float64: ``(sum_k cos(d / 10000^(2k/D)) - D/2) / c_h``, ``c_h = 8h/H``.

    float64 because the argument ``d * 10000^(-2k/D)`` would lose about
    ``d * 6e-8`` radians in float32: noticeable at long distances.
    """
    k = torch.arange(sandwich_dim // 2, dtype=torch.float64, device=distance.device)
    frequencies = SINUSOID_BASE ** (-2.0 * k / sandwich_dim)
    d = distance.to(torch.float64)
    inner = torch.cos(frequencies[:, None] * d[None, :]).sum(0) - sandwich_dim / 2  # p_i . p_j - D/2
    compression = 8.0 * torch.arange(1, num_heads + 1, dtype=torch.float64, device=distance.device) / num_heads
    return inner[None, :] / compression[:, None]


@register_kernel("sandwich")
class SandwichKernel(BiasKernel):
    """``B_h(d) = (sum_{k=0}^{D/2-1} cos(d / 10000^(2k/D)) - D/2) / c_h``, ``c_h = 8h/H``.

    Sandwich (Chi et al., ACL 2023), §6.1 Eq. 6 and the reference code of
    Appendix E: the inner product of two ``D``-dimensional sinusoidal embeddings
    (``--sandwich-dim``, 128), shifted to 0 at ``d = 0`` and divided by ALiBi's
    compression ratios. Parameter-free.
    """

    options = SandwichOptions

    def __init__(self, num_heads: int, sandwich_dim: int = 128):
        super().__init__(num_heads)
        self.sandwich_dim = check_dim(sandwich_dim)

    def forward(self, distance: Tensor) -> Tensor:
        return sandwich_curves(self.num_heads, self.sandwich_dim, distance).to(self.compute_dtype())


@dataclass
class SandwichSmoothedOptions(SandwichOptions):
    sandwich_fit_distances: int = field(
        default=50,
        metadata={"help": "sandwich_smoothed: fit each head's log curve to Sandwich at distances "
                  "0..N-1 (the paper's implementation: the 50 nearest; its Figure 9 fit of "
                  "a=0.825, b=-0.8 comes from a whole 8192-token row)"},
    )


def fit_log_curves(curves: Tensor) -> List[Tuple[float, float]]:
    """Least-squares ``(a_h, b_h)`` of ``y = -a_h * log(1 + d) + b_h`` to each row of ``curves``
    (``[heads, n]``, distances ``0..n-1``)."""
    d = torch.arange(curves.size(1), dtype=torch.float64)
    design = torch.stack([-torch.log1p(d), torch.ones_like(d)], dim=1)  # [n, 2]
    solution = torch.linalg.lstsq(design, curves.to(torch.float64).T).solution  # [2, heads]
    return [(float(a), float(b)) for a, b in solution.T]


@register_kernel("sandwich_smoothed")
class SandwichSmoothedKernel(BiasKernel):
    """``B_h(d) = -a_h * log(1 + d) + b_h``, ``(a_h, b_h)`` the least-squares fit of head ``h``'s
    Sandwich curve over distances ``0..N-1`` (``--sandwich-fit-distances``, 50).

    Sandwich (Chi et al., ACL 2023), §6.2 and its footnote 7 ("Smoothed"
    column of Table 3); for ``c = 8, D = 128`` fitted over an 8192-token row the
    paper reports ``a = 0.825, b = -0.8`` (Fig. 9). Fixed at construction, no
    learnable parameters.
    """

    options = SandwichSmoothedOptions

    def __init__(self, num_heads: int, sandwich_dim: int = 128, sandwich_fit_distances: int = 50):
        super().__init__(num_heads)
        if sandwich_fit_distances < 2:
            raise KernelConfigError(
                f"--sandwich-fit-distances must be at least 2 (two parameters per head), got {sandwich_fit_distances}")
        distances = torch.arange(sandwich_fit_distances, dtype=torch.float64)
        self.coefficients = fit_log_curves(sandwich_curves(num_heads, check_dim(sandwich_dim), distances))

    def forward(self, distance: Tensor) -> Tensor:
        a, b = (per_head_column(column, self.compute_dtype(), distance.device) for column in zip(*self.coefficients))
        return -a * torch.log1p(distance.to(a.dtype))[None, :] + b
