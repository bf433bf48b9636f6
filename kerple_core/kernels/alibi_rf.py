"""ALiBi with a local receptive field: the linear penalty fades with distance."""

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from fairseq.dataclass import ChoiceEnum
from torch import Tensor

from kerple_core.errors import KernelConfigError
from kerple_core.kernels.alibi import AlibiSlopeOptions, head_slopes
from kerple_core.kernels.base import per_head_column
from kerple_core.kernels.constraints import LearnableKernelOptions
from kerple_core.kernels.learnable import LearnableKernel
from kerple_core.kernels.registry import register_kernel

DECAYS = ["exponential", "gaussian", "reciprocal"]


@dataclass
class AlibiReceptiveFieldOptions(AlibiSlopeOptions, LearnableKernelOptions):
    alibi_rf_decay: ChoiceEnum(DECAYS) = field(
        default="exponential",
        metadata={"help": "alibi_rf's decay f_rho(d): exponential exp(-d/rho), gaussian "
                  "exp(-d^2/(2 rho^2)) or reciprocal rho/(rho+d)"},
    )
    alibi_rf_rho: float = field(
        default=512.0,
        metadata={"help": "alibi_rf's receptive-field scale rho (> 0, in tokens), the same for every "
                  "head; the initial value when --alibi-rf-learnable-rho is on"},
    )
    alibi_rf_learnable_rho: bool = field(
        default=False,
        metadata={"help": "learn one rho per head, kept above --kernel-param-floor as "
                  "--kernel-parameterization says (softplus: rho_h = floor + softplus(theta_h))"},
    )


@register_kernel("alibi_rf")
class AlibiReceptiveFieldKernel(LearnableKernel):
    """``B_h(d) = -m_h * d * f_rho(d)``, ALiBi's slopes ``m_h`` and a decay ``f``:
    ``exp(-d/rho)``, ``exp(-d^2/(2 rho^2))`` or ``rho/(rho+d)``.

    A proposal, "ALiBi with a local receptive field" (§§3-8),
    untested in the literature. ``rho`` is fixed (``--alibi-rf-rho``) or learned
    per head (``--alibi-rf-learnable-rho``, kept in its domain by
    ``--kernel-parameterization``); the slope options
    of ``alibi`` apply. With the exponential and Gaussian decays the penalty is
    largest at ``d ~ rho`` and returns towards 0 beyond it; the reciprocal one
    saturates at ``-m_h * rho``.
    """

    options = AlibiReceptiveFieldOptions

    def __init__(self, num_heads: int, kernel_param_floor: float = 1e-2, kernel_parameterization: str = "clamp",
                 alibi_shift: float = 0.0,
                 alibi_equal_slope: Optional[float] = None, alibi_rf_decay: str = "exponential",
                 alibi_rf_rho: float = 512.0, alibi_rf_learnable_rho: bool = False):
        super().__init__(num_heads, kernel_param_floor, kernel_parameterization)
        decay = str(alibi_rf_decay)
        if decay not in DECAYS:
            raise KernelConfigError(f"--alibi-rf-decay must be one of {', '.join(DECAYS)}, got {decay!r}")
        if not (math.isfinite(alibi_rf_rho) and alibi_rf_rho > self.floor):
            raise KernelConfigError(
                f"--alibi-rf-rho must be a finite number above --kernel-param-floor ({self.floor:g}), "
                f"got {alibi_rf_rho}")
        self.decay = decay
        self.slopes = head_slopes(num_heads, alibi_shift, alibi_equal_slope)
        self.fixed_rho = None if alibi_rf_learnable_rho else float(alibi_rf_rho)
        if alibi_rf_learnable_rho:
            self.add_parameter("rho", torch.full((num_heads,), float(alibi_rf_rho)))

    def receptive_field(self, device) -> Tensor:
        """``[num_heads, 1]`` receptive-field scales."""
        if self.fixed_rho is None:
            return self.column("rho")
        return torch.full((self.num_heads, 1), self.fixed_rho, dtype=self.compute_dtype(), device=device)

    def forward(self, distance: Tensor) -> Tensor:
        rho = self.receptive_field(distance.device)
        d = distance.to(rho.dtype)[None, :]
        slopes = per_head_column(self.slopes, rho.dtype, distance.device)
        if self.decay == "exponential":
            fade = torch.exp(-d / rho)
        elif self.decay == "gaussian":
            fade = torch.exp(-d.square() / (2 * rho.square()))
        else:
            fade = rho / (rho + d)
        return -slopes * d * fade

    def extra_repr(self) -> str:
        rho = "learnable" if self.fixed_rho is None else f"{self.fixed_rho:g}"
        return f"{super().extra_repr()}, decay={self.decay}, rho={rho}"
