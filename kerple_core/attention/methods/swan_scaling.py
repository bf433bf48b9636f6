"""SWAN-GPT's dynamic attention scaling of its global NoPE layers at inference (``--swan-scaling``)."""

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kerple_core.attention.methods.base import register_attention_method
from kerple_core.attention.methods.position_factor import PositionFactor
from kerple_core.errors import KernelConfigError

#: the base ``a`` of the reimplementation of SWAN-GPT in Tencent-Hunyuan/HiLS-Attention; the paper tunes it per
#: model after training (HypeNet's retrained SWAN-GPT baseline uses 1000)
SWAN_SCALING_BASE = 362.0


@dataclass
class SwanScalingOptions:
    swan_scaling: bool = field(default=False, metadata={
        "help": "SWAN-GPT's dynamic attention scaling: at evaluation, the query at position i times log(i + a) / "
        "log(a) in the layers without rotary embeddings; for any model: --model-overrides "
        "\"{'swan_scaling': True}\""})
    swan_scaling_base: float = field(default=SWAN_SCALING_BASE, metadata={
        "help": "SWAN-GPT's dynamic attention scaling: the base a (> 1), tuned per model after training"})


@register_attention_method("swan_scaling")
class SwanScaling(PositionFactor):
    """SWAN-GPT's dynamic attention scaling (Puvvada et al., "SWAN-GPT: An Efficient and Scalable Approach
    for Long-Context Language Modeling", NVIDIA, 2025): at inference, the logits of the query at 0-based
    position ``i`` in the global NoPE layers are multiplied by ``s_i = log_a(i + a) = log(i + a) / log(a)``,
    1 at the first token and growing with the log of the position, with no floor and no threshold at the
    training length. Applied to the query, as the reimplementation in ``Tencent-Hunyuan/HiLS-Attention``
    (``models/FullAttn/modeling_fullattn.py``, ``a = 362``) does, and as HypeNet (2026, Eq. 11) restates
    it; the paper fits ``a`` per model on long samples. It acts in the layers without rotary embeddings
    (SWAN-GPT's global layers) and only in evaluation mode (training sees ``s = 1``, as the reference's
    ``not self.training``); a positional bias added to the logits is not scaled. No parameters: set it
    on any trained model with ``--model-overrides``."""

    options = SwanScalingOptions
    switch = "swan_scaling"
    evaluation_only = True
    layer_rule = "acts in the layers without rotary embeddings only (SWAN-GPT's global NoPE layers)"

    @classmethod
    def acts_in_layer(cls, cfg, rotary: bool) -> bool:
        return not rotary

    def __init__(self, num_heads: int = 0, head_dim: int = 0, swan_scaling: bool = True,
                 swan_scaling_base: float = SWAN_SCALING_BASE):
        super().__init__()
        if not (math.isfinite(swan_scaling_base) and swan_scaling_base > 1):
            raise KernelConfigError(f"--swan-scaling-base must be a finite number > 1, got {swan_scaling_base}")
        self.base = float(swan_scaling_base)

    def factor(self, positions: Tensor) -> Tensor:
        return torch.log(positions + self.base) / math.log(self.base)

    def extra_repr(self) -> str:
        return f"base={self.base:g}"
