"""KERPLE's power variant."""

import torch
from torch import Tensor, nn

from kerple_fairseq.kernels.base import BiasKernel
from kerple_fairseq.kernels.constraints import (
    LearnableKernelOptions,
    bounded,
    bounded_inverse,
    check_floor,
    positive,
    positive_inverse,
)
from kerple_fairseq.kernels.registry import register_kernel

MAX_POWER = 2.0


def distance_power(distance: Tensor, power: Tensor) -> Tensor:
    """``d ** p`` for ``d >= 0``, ``p > 0``, with ``0 ** p = 0`` and a finite gradient in ``p`` at ``d = 0``."""
    positive_d = distance > 0
    safe = torch.where(positive_d, distance, torch.ones_like(distance))
    return torch.where(positive_d, safe.pow(power), torch.zeros_like(safe))


@register_kernel("kerple_power")
class KerplePowerKernel(BiasKernel):
    """``B_h(d) = -r1_h * d^r2_h``, learnable ``r1_h > 0`` and ``0 < r2_h <= 2``.

    KERPLE (Chi et al., NeurIPS 2022), §4, the power variant of Corollary 1.
    Reference initialisation ``r1 ~ U[0, 1)``, ``r2 ~ U[0, 2)``. ``r1`` is kept
    above ``--kernel-param-floor`` by softplus, ``r2`` inside
    ``(floor, 2)`` by a scaled sigmoid.
    """

    options = LearnableKernelOptions

    def __init__(self, num_heads: int, kernel_param_floor: float = 1e-2):
        super().__init__(num_heads)
        self.floor = check_floor(kernel_param_floor)
        self.r1_raw = nn.Parameter(positive_inverse(torch.rand(num_heads), self.floor))
        self.r2_raw = nn.Parameter(
            bounded_inverse(torch.rand(num_heads) * MAX_POWER, self.floor, MAX_POWER)
        )

    @property
    def r1(self) -> Tensor:
        return positive(self.r1_raw.to(self.compute_dtype()), self.floor)

    @property
    def r2(self) -> Tensor:
        return bounded(self.r2_raw.to(self.compute_dtype()), self.floor, MAX_POWER)

    def forward(self, distance: Tensor) -> Tensor:
        r1, r2 = self.r1[:, None], self.r2[:, None]
        return -r1 * distance_power(distance.to(r1.dtype)[None, :], r2)
