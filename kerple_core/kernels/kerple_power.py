"""KERPLE's power variant."""

from torch import Tensor

from kerple_core.kernels.learnable import LearnableKernel, distance_power, uniform
from kerple_core.kernels.registry import register_kernel


@register_kernel("kerple_power")
class KerplePowerKernel(LearnableKernel):
    """``B_h(d) = -r1_h * d^r2_h``, learnable ``r1_h > 0`` and ``0 < r2_h <= 2``.

    KERPLE (Chi et al., NeurIPS 2022), §4, the power variant of Corollary 1.
    Reference initialisation ``r1 ~ U[0, 1)``, ``r2 ~ U[0, 2)``. ``r1`` is kept
    at or above ``--kernel-param-floor``, ``r2`` in ``[floor, 2]``, as
    ``--kernel-parameterization`` says.
    """

    def __init__(self, num_heads: int, **constraint_options):
        super().__init__(num_heads, **constraint_options)
        self.add_parameter("r1", uniform(num_heads, 1.0))
        self.add_power("r2", uniform(num_heads, 2.0))

    def forward(self, distance: Tensor) -> Tensor:
        r1, r2 = self.column("r1"), self.column("r2")
        return -r1 * distance_power(distance.to(r1.dtype), r2)
