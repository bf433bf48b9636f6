"""YaRN (``--rotary-scaling yarn``; Peng et al., 2023, "YaRN: Efficient Context Window Extension of Large
Language Models", §3): at the scale ``s = max(1, --rotary-scaling-length / training length)``, each pair's
frequency ramps from ``theta_k`` (dimensions of more than ``beta_fast = 32`` rotations over the training
length, kept) to ``theta_k / s`` (of fewer than ``beta_slow = 1``, interpolated), and queries and keys are
multiplied by ``0.1 ln s + 1`` (so the logits by ``(0.1 ln s + 1)^2``)."""

import math

import torch
from torch import Tensor

from kerple_core.attention.rotary.rotation import ROTARY_BASE
from kerple_core.attention.rotary.scalings.base import RotaryScaling, register_rotary_scaling

#: YaRN's correction range: dimensions of more than 32 rotations over the training length are kept,
#: of fewer than 1 interpolated (its beta_fast, beta_slow)
YARN_BETA_FAST, YARN_BETA_SLOW = 32, 1


@register_rotary_scaling("yarn")
class YaRN(RotaryScaling):
    precedence = 3

    def frequencies(self, rotary, theta: Tensor, s: float) -> Tensor:
        if s == 1.0:
            return theta
        dim = rotary.head_dim

        def correction(rotations: float) -> float:
            return dim * math.log(rotary.train_length / (2 * math.pi * rotations)) / (2 * math.log(ROTARY_BASE))

        k = torch.arange(dim // 2, dtype=torch.float64, device=theta.device)
        low = max(math.floor(correction(YARN_BETA_FAST)), 0)
        high = min(math.ceil(correction(YARN_BETA_SLOW)), dim - 1)
        ramp = ((k - low) / max(high - low, 1e-3)).clamp(0.0, 1.0)
        return (1 - ramp) * theta + ramp * theta / s

    def magnitude(self, rotary, s: float) -> float:
        return 0.1 * math.log(s) + 1.0
