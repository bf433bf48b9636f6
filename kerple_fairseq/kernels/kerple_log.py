"""KERPLE's logarithmic variant."""

import torch
from torch import Tensor, nn

from kerple_fairseq.kernels.base import BiasKernel
from kerple_fairseq.kernels.constraints import (
    LearnableKernelOptions,
    check_floor,
    positive,
    positive_inverse,
)
from kerple_fairseq.kernels.registry import register_kernel


@register_kernel("kerple_log")
class KerpleLogKernel(BiasKernel):
    """``B_h(d) = -r1_h * log(1 + r2_h * d)``, learnable ``r1_h, r2_h > 0``.

    KERPLE (Chi et al., NeurIPS 2022), §4, the logarithmic variant of Corollary 1.
    Reference initialisation ``r1 ~ U[0, 2)``, ``r2 ~ U[0, 1)``; both are kept
    above ``--kernel-param-floor`` (1e-2) by the softplus reparameterisation of
    :mod:`kerple_fairseq.kernels.constraints`.
    """

    options = LearnableKernelOptions

    def __init__(self, num_heads: int, kernel_param_floor: float = 1e-2):
        super().__init__(num_heads)
        self.floor = check_floor(kernel_param_floor)
        self.r1_raw = nn.Parameter(positive_inverse(torch.rand(num_heads) * 2.0, self.floor))
        self.r2_raw = nn.Parameter(positive_inverse(torch.rand(num_heads), self.floor))

    @property
    def r1(self) -> Tensor:
        return positive(self.r1_raw.to(self.compute_dtype()), self.floor)

    @property
    def r2(self) -> Tensor:
        return positive(self.r2_raw.to(self.compute_dtype()), self.floor)

    def forward(self, distance: Tensor) -> Tensor:
        r1, r2 = self.r1[:, None], self.r2[:, None]
        return -r1 * torch.log1p(r2 * distance.to(r1.dtype)[None, :])
