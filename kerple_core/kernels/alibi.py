"""ALiBi: a fixed linear penalty per head, and Sandwich's slope experiments."""

import math
from dataclasses import dataclass, field
from typing import List, Optional

from torch import Tensor

from kerple_core.errors import KernelConfigError
from kerple_core.kernels.base import BiasKernel, per_head_column
from kerple_core.kernels.registry import register_kernel


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


@dataclass
class AlibiSlopeOptions:
    alibi_shift: float = field(
        default=0.0,
        metadata={"help": "ALiBi slope shift DELTA (Sandwich §4.1): every slope is multiplied by "
                  "2^-DELTA, i.e. m_h = 2^-(8h/H + DELTA); 0 keeps Press's slopes"},
    )
    alibi_equal_slope: Optional[float] = field(
        default=None,
        metadata={"help": "give every head the same ALiBi slope m = 2^-X (Sandwich §4.2 sweeps "
                  "X = 0..8) instead of the geometric sequence"},
    )


def head_slopes(num_heads: int, alibi_shift: float = 0.0, alibi_equal_slope: Optional[float] = None) -> List[float]:
    """Press's slopes, optionally shifted by ``2^-alibi_shift`` or all equal to ``2^-alibi_equal_slope``."""
    for flag, value in (("--alibi-shift", alibi_shift), ("--alibi-equal-slope", alibi_equal_slope)):
        if value is not None and not math.isfinite(value):
            raise KernelConfigError(f"{flag} must be a finite number, got {value}")
    if alibi_equal_slope is not None:
        if alibi_shift:
            raise KernelConfigError(
                "--alibi-shift and --alibi-equal-slope are two different experiments; give one of them"
            )
        return [2.0 ** -alibi_equal_slope] * num_heads
    return [m * 2.0 ** -alibi_shift for m in alibi_slopes(num_heads)]


@register_kernel("alibi")
class AlibiKernel(BiasKernel):
    """``B_h(d) = -m_h * d`` with Press's fixed geometric slopes ``m_h``.

    ALiBi (Press et al., ICLR 2022, §3); the non-power-of-two head rule is the
    one of the ALiBi reference code, restated in Sandwich (Chi et al., 2023)
    eq. 3. ``--alibi-shift DELTA`` uses ``m_h = 2^-(8h/H + DELTA)`` and
    ``--alibi-equal-slope X`` gives every head ``m = 2^-X`` (Sandwich §4.1, §4.2).
    No learnable parameters.
    """

    options = AlibiSlopeOptions

    def __init__(self, num_heads: int, alibi_shift: float = 0.0, alibi_equal_slope: Optional[float] = None):
        super().__init__(num_heads)
        # a plain list, not a buffer: model.half() must not round the slopes
        self.slopes = head_slopes(num_heads, alibi_shift, alibi_equal_slope)

    def linear_slopes(self) -> List[float]:
        return self.slopes

    def forward(self, distance: Tensor) -> Tensor:
        slopes = per_head_column(self.slopes, self.compute_dtype(), distance.device)
        return -slopes * distance.to(slopes.dtype)[None, :]
