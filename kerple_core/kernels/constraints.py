"""How a learnable kernel parameter is kept inside its domain ``[floor, high]``: two parameterizations.

``clamp`` follows KERPLE's reference code (its GPT-NeoX fork clamps each parameter's data in
place at every forward). The stored parameter is the value itself, initialised as drawn; the
kernel uses ``clamp(value, floor, high)``, and the gradient of the clamped value reaches the
stored one unchanged, inside the box and outside it. That is the reference under mixed precision:
its in-place clamp acts on the half-precision copy that the forward reads, so the gradient is
taken at the clamped value, while the optimiser's fp32 master copy, never clamped, takes the
step. An optimiser step therefore moves the value itself (Adam: by about ``lr``).

``softplus`` stores an unconstrained ``raw`` tensor and uses ``floor + softplus(raw)``, or
``floor + (high - floor) * sigmoid(raw)`` for a bounded parameter. A step moves the value by
``lr * d value / d raw``: about 0.01x ``lr`` just above the floor, 0.6x at a value of 1.

Either way the *effective* value, the one the forward uses, lies in the domain for any stored
tensor, fp16 master weights and checkpoints included; logs and analyses show effective values.
"""

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from fairseq.dataclass import ChoiceEnum
from torch import Tensor

from kerple_core.errors import KernelConfigError

PARAMETERIZATIONS = ["clamp", "softplus"]


@dataclass
class LearnableKernelOptions:
    kernel_param_floor: float = field(
        default=1e-2,
        metadata={
            "help": "lower bound of the learnable kernel parameters (KERPLE's r1, r2 > 0), learnable "
            "powers of the distance included (they lie in [floor, 2]); the reference value is 1e-2"
        },
    )
    kernel_parameterization: ChoiceEnum(PARAMETERIZATIONS) = field(
        default="clamp",
        metadata={
            "help": "how learnable kernel parameters stay in their domain. clamp (KERPLE's reference): "
            "the parameter is the value, initialised as drawn, used as clamp(value, floor[, 2]) with "
            "the gradient passed straight through; softplus: value = floor + softplus(raw) (a scaled "
            "sigmoid for powers), smooth, but steps near the floor are about 100x smaller"
        },
    )


def check_floor(floor: float) -> float:
    if not 0.0 < floor < 1.0:
        raise KernelConfigError(
            f"--kernel-param-floor must be in (0, 1), got {floor}; the reference value is 1e-2"
        )
    return float(floor)


def straight_through_clamp(stored: Tensor, low: float, high: float) -> Tensor:
    """``clamp(stored, low, high)`` exactly, with derivative 1 everywhere (forward and reverse mode)."""
    return stored.detach().clamp(low, high) + (stored - stored.detach())


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


class Clamp:
    """The stored tensor is the value; the forward clamps it (straight-through gradient)."""

    name = "clamp"
    suffix = ""  # state-dict key of parameter r1: "r1"

    @staticmethod
    def stored(value: Tensor, low: float, high: float) -> Tensor:
        return value.clone()

    @staticmethod
    def effective(stored: Tensor, low: float, high: float) -> Tensor:
        return straight_through_clamp(stored, low, high)


class Softplus:
    """The stored tensor is ``raw``; softplus (or a scaled sigmoid below ``high``) maps it inside."""

    name = "softplus"
    suffix = "_raw"  # state-dict key of parameter r1: "r1_raw"

    @staticmethod
    def stored(value: Tensor, low: float, high: float) -> Tensor:
        return positive_inverse(value, low) if math.isinf(high) else bounded_inverse(value, low, high)

    @staticmethod
    def effective(stored: Tensor, low: float, high: float) -> Tensor:
        return positive(stored, low) if math.isinf(high) else bounded(stored, low, high)


def parameterization(name: str):
    """The parameterization called ``name`` (``--kernel-parameterization``)."""
    for p in (Clamp, Softplus):
        if p.name == str(name):
            return p
    raise KernelConfigError(
        f"--kernel-parameterization must be one of {', '.join(PARAMETERIZATIONS)}, got {name!r}")
