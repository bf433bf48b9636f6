"""ALiBi: a fixed linear penalty per head."""

import math
from typing import List

import torch
from torch import Tensor

from kerple_fairseq.kernels.base import BiasKernel
from kerple_fairseq.kernels.registry import register_kernel


def alibi_slopes(num_heads: int) -> List[float]:
    """Press et al.'s head slopes.

    For a power of two ``H``: ``m_h = 2^(-8h/H)``, ``h = 1..H``. Otherwise, with
    ``n = 2^floor(log2 H)``: the ``n`` slopes for ``n`` heads, then every other
    slope of the ``2n``-head sequence (the 1st, 3rd, ...), the first ``H - n`` of them.
    """

    def geometric(n: int) -> List[float]:
        return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]

    n = 2 ** int(math.floor(math.log2(num_heads)))
    return geometric(n) + geometric(2 * n)[0::2][: num_heads - n]


@register_kernel("alibi")
class AlibiKernel(BiasKernel):
    """``B_h(d) = -m_h * d`` with Press's fixed geometric slopes ``m_h``.

    ALiBi (Press et al., ICLR 2022, §3); the non-power-of-two head rule is the
    one of the ALiBi reference code, restated in Sandwich (Chi et al., 2023) eq. 3.
    No learnable parameters.
    """

    def __init__(self, num_heads: int):
        super().__init__(num_heads)
        # a plain list, not a buffer: model.half() must not round the slopes
        self.slopes = alibi_slopes(num_heads)

    def forward(self, distance: Tensor) -> Tensor:
        slopes = torch.tensor(self.slopes, dtype=self.compute_dtype(), device=distance.device)
        return -slopes[:, None] * distance.to(slopes.dtype)[None, :]
