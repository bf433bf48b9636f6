"""KERPLE's three-parameter logarithmic variant."""

import torch
from torch import Tensor

from kerple_core.kernels.learnable import LearnableKernel, distance_power, uniform
from kerple_core.kernels.registry import register_kernel


@register_kernel("kerple_log3")
class KerpleLog3Kernel(LearnableKernel):
    """``B_h(d) = -r1_h * log(1 + r2_h * d^r3_h)``, learnable ``r1, r2 > 0``, ``0 < r3 <= 2``.

    KERPLE (Chi et al., NeurIPS 2022), §5.3, "3-para-log"; ``r3 = 1`` is the
    logarithmic variant. ``r1 ~ U[0, 2)`` and ``r2 ~ U[0, 1)`` as for
    ``kerple_log``; the paper gives no initialisation for ``r3``, which starts
    at 1 so that training begins from the logarithmic variant.
    """

    def __init__(self, num_heads: int, **constraint_options):
        super().__init__(num_heads, **constraint_options)
        self.add_parameter("r1", uniform(num_heads, 2.0))
        self.add_parameter("r2", uniform(num_heads, 1.0))
        self.add_power("r3", torch.ones(num_heads))

    def forward(self, distance: Tensor) -> Tensor:
        r1, r2, r3 = self.column("r1"), self.column("r2"), self.column("r3")
        return -r1 * (r2 * distance_power(distance.to(r1.dtype), r3)).log1p()
