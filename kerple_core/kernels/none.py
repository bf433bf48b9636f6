"""No positional bias: the causal mask alone (NoPE)."""

from typing import List

from torch import Tensor

from kerple_core.kernels.base import BiasKernel
from kerple_core.kernels.registry import register_kernel


@register_kernel("none")
class NoBiasKernel(BiasKernel):
    """``B_h(d) = 0``: attention sees order only through the causal mask.

    The NoPE baseline (no positional information besides causality), compared
    against in lectures on position encoding and length generalization (Khapra) and
    used as the cost baseline.
    """

    encodes_position = False

    def linear_slopes(self) -> List[float]:
        return [0.0] * self.num_heads

    def forward(self, distance: Tensor) -> Tensor:
        return self.zeros(distance)
