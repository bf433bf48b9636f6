"""T5's learned, log-bucketed relative position bias."""

import math
from dataclasses import dataclass, field

import torch
from fairseq.dataclass import ChoiceEnum
from torch import Tensor, nn

from kerple_core.errors import KernelConfigError
from kerple_core.kernels.base import BiasKernel
from kerple_core.kernels.registry import register_kernel


T5_INITS = ["xavier_normal", "normal"]
T5_BIAS_SCALES = ["sqrt_head_dim", "none"]
NORMAL_INIT_STD = 0.02


@dataclass
class T5Options:
    t5_num_buckets: int = field(
        default=32, metadata={"help": "t5: buckets per head; distances below half of them get one each"}
    )
    t5_max_distance: int = field(
        default=128, metadata={"help": "t5: distances from this on share the last bucket"}
    )
    t5_init: ChoiceEnum(T5_INITS) = field(
        default="xavier_normal",
        metadata={"help": "t5: initialisation of the [buckets, heads] table: xavier_normal, std "
                  "sqrt(2 / (buckets + heads)) (KERPLE's T5 baseline), or normal, std 0.02"},
    )
    t5_bias_scale: ChoiceEnum(T5_BIAS_SCALES) = field(
        default="sqrt_head_dim",
        metadata={"help": "t5: sqrt_head_dim multiplies the looked-up bias by sqrt(head width) before it "
                  "is added to the scaled logits (KERPLE's T5 baseline); none adds it as it is"},
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
    """``B_h(d) = s * b[bucket(d), h]``, a learned ``[--t5-num-buckets, heads]`` table ``b``, and
    ``s = sqrt(head_dim)`` (``--t5-bias-scale sqrt_head_dim``) or 1 (``none``).

    T5 (Raffel et al., JMLR 2020, §2.1) as compared in KERPLE §4 (the bucket
    formula below its Eq. 6): causal, exact below 16, logarithmic up to
    ``--t5-max-distance`` 128, 32 buckets. KERPLE's statement omits the ``+16``
    offset of the logarithmic buckets; this follows T5's reference implementation,
    which has it. By default the kernel is KERPLE's T5 baseline as its code builds
    it: a Xavier-normal table (``--t5-init``) whose entries are multiplied by
    ``sqrt(head_dim)`` before they are added to the logits scaled by
    ``1/sqrt(head_dim)``. Whether the scale applies is saved with the table
    (``scaled_by_sqrt_head_dim``), so a checkpoint keeps its meaning whatever
    the options it is loaded with; a table saved before the scale existed is
    ``[heads, buckets]``, unscaled, and is loaded as such.
    """

    options = T5Options
    needs_head_dim = True

    def __init__(self, num_heads: int, head_dim: int, t5_num_buckets: int = 32, t5_max_distance: int = 128,
                 t5_init: str = "xavier_normal", t5_bias_scale: str = "sqrt_head_dim"):
        super().__init__(num_heads)
        if t5_num_buckets < 2:
            raise KernelConfigError(f"--t5-num-buckets must be at least 2, got {t5_num_buckets}")
        if t5_max_distance <= t5_num_buckets // 2:
            raise KernelConfigError(
                f"--t5-max-distance must exceed half of --t5-num-buckets ({t5_num_buckets // 2}), "
                f"got {t5_max_distance}")
        for flag, value, choices in (("--t5-init", t5_init, T5_INITS), ("--t5-bias-scale", t5_bias_scale, T5_BIAS_SCALES)):
            if str(value) not in choices:
                raise KernelConfigError(f"{flag} must be one of {', '.join(choices)}, got {value!r}")
        if head_dim < 1:
            raise KernelConfigError(f"the attention head width must be >= 1, got {head_dim}")
        self.num_buckets, self.max_distance, self.head_dim = t5_num_buckets, t5_max_distance, head_dim
        self.table = nn.Parameter(torch.empty(t5_num_buckets, num_heads))
        if str(t5_init) == "xavier_normal":
            nn.init.xavier_normal_(self.table)
        else:
            nn.init.normal_(self.table, std=NORMAL_INIT_STD)
        self.register_buffer("scaled_by_sqrt_head_dim", torch.tensor(str(t5_bias_scale) == "sqrt_head_dim"))
        self.scale = self._scale()

    def _scale(self) -> float:
        return math.sqrt(self.head_dim) if bool(self.scaled_by_sqrt_head_dim) else 1.0

    def forward(self, distance: Tensor) -> Tensor:
        buckets = t5_buckets(distance, self.num_buckets, self.max_distance)
        looked_up = self.table.to(self.compute_dtype())[buckets].T
        return looked_up if self.scale == 1.0 else looked_up * self.scale

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        flag, table = prefix + "scaled_by_sqrt_head_dim", prefix + "table"
        if flag not in state_dict and table in state_dict:
            # saved before the scale and the [buckets, heads] layout: an unscaled [heads, buckets] table
            state_dict[table] = state_dict[table].T
            state_dict[flag] = torch.tensor(False)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.scale = self._scale()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, buckets={self.num_buckets}, max_distance={self.max_distance}, scale={self.scale:g}"
