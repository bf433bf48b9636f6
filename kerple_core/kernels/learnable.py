"""Kernels with learnable per-head parameters kept inside their domains."""

import math
from typing import Dict

import torch
from torch import Tensor, nn

from kerple_core.errors import KernelConfigError
from kerple_core.kernels.base import BiasKernel
from kerple_core.kernels.constraints import (
    Clamp,
    LearnableKernelOptions,
    Softplus,
    check_floor,
    parameterization,
)
from kerple_core.precision import precise

#: the largest power a distance may be raised to (KERPLE Fact 5: beyond 2 the kernel is not CPD)
MAX_POWER = 2.0


class LearnableKernel(BiasKernel):
    """A :class:`BiasKernel` whose parameters are per head and constrained.

    ``add_parameter("r1", init)`` stores an ``nn.Parameter`` of shape ``[num_heads]``
    as ``--kernel-parameterization`` says (:mod:`kerple_core.kernels.constraints`):
    ``r1`` holding the value itself (``clamp``) or ``r1_raw`` (``softplus``);
    ``value("r1")`` is the effective value in ``[floor, high]``, in the compute
    dtype, whatever the optimiser wrote. Loading a ``softplus`` state dict into a
    ``clamp`` kernel stores its effective values: the same bias, bit for bit.
    """

    options = LearnableKernelOptions
    per_head_parameters = True

    def __init__(self, num_heads: int, kernel_param_floor: float = 1e-2, kernel_parameterization: str = "clamp"):
        super().__init__(num_heads)
        self.floor = check_floor(kernel_param_floor)
        self.parameterization = parameterization(kernel_parameterization)
        self.upper_bounds: Dict[str, float] = {}

    def add_parameter(self, name: str, init: Tensor, high: float = math.inf) -> None:
        """Learn ``name`` in ``[floor, high]``, starting from the values ``init``."""
        if init.shape != (self.num_heads,):
            raise ValueError(f"{name}: expected {self.num_heads} initial values, got shape {tuple(init.shape)}")
        self.upper_bounds[name] = high
        stored = self.parameterization.stored(init, self.floor, high)
        self.register_parameter(name + self.parameterization.suffix, nn.Parameter(stored))

    def add_power(self, name: str, init: Tensor) -> None:
        """A learnable exponent of the distance, in ``[floor, 2]``."""
        self.add_parameter(name, init, MAX_POWER)

    def value(self, name: str) -> Tensor:
        """The effective ``[num_heads]`` values of parameter ``name``."""
        stored = getattr(self, name + self.parameterization.suffix).to(self.compute_dtype())
        return self.parameterization.effective(stored, self.floor, self.upper_bounds[name])

    def column(self, name: str) -> Tensor:
        """``value(name)`` as a ``[num_heads, 1]`` column, to broadcast against distances."""
        return self.value(name)[:, None]

    def values(self) -> Dict[str, Tensor]:
        """Every learnable parameter's effective values, by name (for logs and analysis)."""
        return {name: self.value(name) for name in self.upper_bounds}

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name, high in self.upper_bounds.items():
            raw, plain = prefix + name + Softplus.suffix, prefix + name + Clamp.suffix
            if self.parameterization is Clamp and raw in state_dict and plain not in state_dict:
                # a softplus checkpoint (the only kind before --kernel-parameterization existed):
                # its effective values, computed as its forward computed them
                stored = state_dict.pop(raw)
                dtype = precise(stored.dtype)
                state_dict[plain] = Softplus.effective(stored.to(dtype), self.floor, high)
            elif self.parameterization is Softplus and plain in state_dict and raw not in state_dict:
                raise KernelConfigError(
                    f"the {self.name} kernel's parameters were saved with --kernel-parameterization clamp; "
                    "load them with --kernel-parameterization clamp")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def distance_power(distance: Tensor, power) -> Tensor:
    """``d ** p`` for ``d >= 0``, ``p > 0`` (a tensor or a number), with ``0 ** p = 0`` and a
    finite gradient in ``p`` at ``d = 0``."""
    positive_d = distance > 0
    safe = torch.where(positive_d, distance, torch.ones_like(distance))
    return torch.where(positive_d, safe.pow(power), torch.zeros_like(safe))


def uniform(num_heads: int, high: float) -> Tensor:
    """``U[0, high)`` per head, the reference initialisation of KERPLE's parameters."""
    return torch.rand(num_heads) * high


def stretched_exp_decay(distance: Tensor, rate: Tensor, power) -> Tensor:
    """``exp(-rate * d^power)``: the Gaussian (``power = 2``) and its ``(0, 2]`` generalisations."""
    return torch.exp(-rate * distance_power(distance, power))
