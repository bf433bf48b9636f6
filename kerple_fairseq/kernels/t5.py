"""T5's learned, log-bucketed relative position bias."""

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from kerple_fairseq.errors import KernelConfigError
from kerple_fairseq.kernels.base import BiasKernel
from kerple_fairseq.kernels.registry import register_kernel


@dataclass
class T5Options:
    t5_num_buckets: int = field(
        default=32, metadata={"help": "t5: buckets per head; distances below half of them get one each"}
    )
    t5_max_distance: int = field(
        default=128, metadata={"help": "t5: distances from this on share the last bucket"}
    )


def t5_buckets(distance: Tensor, num_buckets: int, max_distance: int) -> Tensor:
    """Causal T5 bucket of each distance ``d >= 0`` (an int64 tensor).

    ``d < E`` (``E = num_buckets // 2``) has bucket ``d``; beyond,
    ``E + floor(log(d / E) / log(max_distance / E) * (num_buckets - E))``, at most
    ``num_buckets - 1``. Computed in float64 (exact for the bucket boundaries).
    """
    exact = num_buckets // 2
    d = distance.to(torch.float64)
    logarithmic = exact + torch.floor(
        torch.log(d.clamp(min=exact) / exact) / math.log(max_distance / exact) * (num_buckets - exact)
    )
    buckets = torch.where(d < exact, d, logarithmic.clamp(max=num_buckets - 1))
    return buckets.to(torch.int64)


@register_kernel("t5")
class T5Kernel(BiasKernel):
    """``B_h(d) = b[h, bucket(d)]``, a learned table of ``--t5-num-buckets`` values per head.

    T5 (Raffel et al., JMLR 2020, §2.1) as compared in KERPLE §4 (the bucket
    formula below its Eq. 6): causal, exact below 16, logarithmic up to
    ``--t5-max-distance`` 128, 32 buckets. KERPLE's statement omits the ``+16``
    offset of the logarithmic buckets; this follows T5's reference implementation,
    which has it. The table starts ``N(0, 0.02^2)``.
    """

    options = T5Options

    def __init__(self, num_heads: int, t5_num_buckets: int = 32, t5_max_distance: int = 128):
        super().__init__(num_heads)
        if t5_num_buckets < 2:
            raise KernelConfigError(f"--t5-num-buckets must be at least 2, got {t5_num_buckets}")
        if t5_max_distance <= t5_num_buckets // 2:
            raise KernelConfigError(
                f"--t5-max-distance must exceed half of --t5-num-buckets ({t5_num_buckets // 2}), "
                f"got {t5_max_distance}")
        self.num_buckets, self.max_distance = t5_num_buckets, t5_max_distance
        self.table = nn.Parameter(torch.randn(num_heads, t5_num_buckets) * 0.02)

    def forward(self, distance: Tensor) -> Tensor:
        buckets = t5_buckets(distance, self.num_buckets, self.max_distance)
        return self.table.to(self.compute_dtype())[:, buckets]
