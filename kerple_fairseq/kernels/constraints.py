"""Reparameterisations that keep learnable kernel parameters inside their domain.

A constrained parameter is stored as an unconstrained ``raw`` tensor and mapped
into its domain on every use. The constraint therefore holds for any value the
optimiser (fp32 master weights included) writes and in every saved checkpoint,
with no projection step to forget.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from kerple_fairseq.errors import KernelConfigError


@dataclass
class LearnableKernelOptions:
    kernel_param_floor: float = field(
        default=1e-2,
        metadata={
            "help": "lower bound of the learnable kernel parameters (KERPLE's r1, r2 > 0), learnable "
            "powers of the distance included (they lie in (floor, 2)); they are stored as "
            "floor + softplus(raw) or a scaled sigmoid, so the bounds hold in every checkpoint"
        },
    )


def check_floor(floor: float) -> float:
    if not 0.0 < floor < 1.0:
        raise KernelConfigError(
            f"--kernel-param-floor must be in (0, 1), got {floor}; the reference value is 1e-2"
        )
    return float(floor)


def positive(raw: Tensor, floor: float) -> Tensor:
    """Map ``raw`` to ``(floor, inf)``: ``floor + softplus(raw)``."""
    return floor + F.softplus(raw)


def positive_inverse(value: Tensor, floor: float) -> Tensor:
    """The ``raw`` giving ``value``; values closer than ``floor`` to the bound are raised to ``2 * floor``."""
    excess = value.clamp(min=2 * floor) - floor
    return excess + torch.log(-torch.expm1(-excess))


def bounded(raw: Tensor, low: float, high: float) -> Tensor:
    """Map ``raw`` to ``(low, high)``: ``low + (high - low) * sigmoid(raw)``."""
    return low + (high - low) * torch.sigmoid(raw)


def bounded_inverse(value: Tensor, low: float, high: float) -> Tensor:
    """The ``raw`` giving ``value``; values within ``low`` of either bound are moved inside."""
    margin = low
    fraction = (value.clamp(min=low + margin, max=high - margin) - low) / (high - low)
    return torch.logit(fraction)
