"""KERPLE's logarithmic variant."""

from torch import Tensor

from kerple_core.kernels.learnable import LearnableKernel, uniform
from kerple_core.kernels.registry import register_kernel


@register_kernel("kerple_log")
class KerpleLogKernel(LearnableKernel):
    """``B_h(d) = -r1_h * log(1 + r2_h * d)``, learnable ``r1_h, r2_h > 0``.

    KERPLE (Chi et al., NeurIPS 2022), §4, the logarithmic variant of Corollary 1.
    Reference initialisation ``r1 ~ U[0, 2)``, ``r2 ~ U[0, 1)``; both are kept
    at or above ``--kernel-param-floor`` (1e-2) as ``--kernel-parameterization``
    says (:mod:`kerple_core.kernels.constraints`; ``clamp`` by default, as the
    reference code does).
    """

    def __init__(self, num_heads: int, **constraint_options):
        super().__init__(num_heads, **constraint_options)
        self.add_parameter("r1", uniform(num_heads, 2.0))
        self.add_parameter("r2", uniform(num_heads, 1.0))

    def forward(self, distance: Tensor) -> Tensor:
        r1, r2 = self.column("r1"), self.column("r2")
        return -r1 * (r2 * distance.to(r1.dtype)).log1p()
