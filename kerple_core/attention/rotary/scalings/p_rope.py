"""p-RoPE (``--rotary-fraction p``; Barbero et al., ICLR 2025, "Round and Round We Go! What makes Rotary
Positional Encodings useful?"): the first ``floor(p D / 2)`` pairs, those of the highest frequencies, rotate
with their usual ``theta_k``, the others are left unrotated (``theta_k = 0``): ``p = 1`` is RoPE, ``p = 0``
no position at all (NoPE)."""

from dataclasses import dataclass, field

import torch
from torch import Tensor

from kerple_core.attention.rotary.scalings.base import RotaryScaling, register_rotary_scaling
from kerple_core.errors import KernelConfigError


@dataclass
class PartialRotaryOptions:
    rotary_fraction: float = field(default=1.0, metadata={
        "help": "p-RoPE: rotate the fraction p of the frequency pairs with the highest frequencies "
        "and leave the rest unrotated (1: rotary, 0: NoPE)"})


@register_rotary_scaling("p-rope")
class PartialRotary(RotaryScaling):
    options = PartialRotaryOptions
    switch = "rotary_fraction"
    precedence = 11
    plain_rotary_only = True

    @classmethod
    def chosen(cls, options, scaling: str) -> bool:
        fraction = getattr(options, "rotary_fraction", None)
        return fraction is not None and fraction < 1.0

    def check_options(self, rotary) -> None:
        if not 0.0 <= rotary.rotary_fraction <= 1.0:
            raise KernelConfigError(f"--rotary-fraction must be in [0, 1] (1: every pair rotated), "
                                    f"got {rotary.rotary_fraction}")

    def frequencies(self, rotary, theta: Tensor, s: float) -> Tensor:
        rotated_pairs = int(rotary.rotary_fraction * rotary.head_dim // 2)
        kept = torch.arange(theta.numel(), device=theta.device) < rotated_pairs
        return torch.where(kept, theta, torch.zeros_like(theta))

    def describe(self, rotary) -> str:
        return ""
