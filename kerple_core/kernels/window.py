"""Windowed attention: every key within the last ``w`` positions, nothing beyond."""

from typing import List

from torch import Tensor

from kerple_core.kernels.base import BiasKernel
from kerple_core.kernels.registry import register_kernel


@register_kernel("window")
class WindowKernel(BiasKernel):
    """``B_h(d) = 0`` for ``d < w`` and ``-inf`` for ``d >= w``, ``w = --attn-window``.

    Windowed attention of Sandwich (Chi et al., ACL 2023), §4.3 Eq. 3, and, with
    rotary positions, Su's super-baseline. The window itself is the model option
    ``--attn-window``, which composes with every kernel (it is applied where the
    bias is laid out, :class:`kerple_core.attention.distance_bias.DistanceBias`);
    this kernel adds nothing inside it, and a model refuses it without a window.
    """

    encodes_position = False
    requires_window = True

    def linear_slopes(self) -> List[float]:
        return [0.0] * self.num_heads

    def forward(self, distance: Tensor) -> Tensor:
        return self.zeros(distance)
