"""Kernels with learnable per-head parameters kept inside their domains."""

import math
from typing import Dict

import torch
from torch import Tensor, nn

from kerple_fairseq.kernels.base import BiasKernel
from kerple_fairseq.kernels.constraints import (
    LearnableKernelOptions,
    bounded,
    bounded_inverse,
    check_floor,
    positive,
    positive_inverse,
)

#: the largest power a distance may be raised to (KERPLE Fact 5: beyond 2 the kernel is not CPD)
MAX_POWER = 2.0


class LearnableKernel(BiasKernel):
    """A :class:`BiasKernel` whose parameters are per head and constrained.

    ``add_parameter("r1", init)`` stores ``r1_raw`` (an ``nn.Parameter`` of shape
    ``[num_heads]``); ``value("r1")`` maps it into ``(floor, high)`` on every use,
    in the compute dtype. The bound therefore holds for whatever the optimiser
    writes, fp16 master weights and checkpoints included.
    """

    options = LearnableKernelOptions
    per_head_parameters = True

    def __init__(self, num_heads: int, kernel_param_floor: float = 1e-2):
        super().__init__(num_heads)
        self.floor = check_floor(kernel_param_floor)
        self.upper_bounds: Dict[str, float] = {}

    def add_parameter(self, name: str, init: Tensor, high: float = math.inf) -> None:
        """Learn ``name`` in ``(floor, high)``, starting from ``init`` (moved inside if on a bound)."""
        if init.shape != (self.num_heads,):
            raise ValueError(f"{name}: expected {self.num_heads} initial values, got shape {tuple(init.shape)}")
        self.upper_bounds[name] = high
        if math.isinf(high):
            raw = positive_inverse(init, self.floor)
        else:
            raw = bounded_inverse(init, self.floor, high)
        self.register_parameter(f"{name}_raw", nn.Parameter(raw))

    def add_power(self, name: str, init: Tensor) -> None:
        """A learnable exponent of the distance, in ``(floor, 2)``."""
        self.add_parameter(name, init, MAX_POWER)

    def value(self, name: str) -> Tensor:
        """The constrained ``[num_heads]`` values of parameter ``name``."""
        raw = getattr(self, f"{name}_raw").to(self.compute_dtype())
        high = self.upper_bounds[name]
        return positive(raw, self.floor) if math.isinf(high) else bounded(raw, self.floor, high)

    def column(self, name: str) -> Tensor:
        """``value(name)`` as a ``[num_heads, 1]`` column, to broadcast against distances."""
        return self.value(name)[:, None]

    def values(self) -> Dict[str, Tensor]:
        """Every learnable parameter's constrained values, by name (for logs and analysis)."""
        return {name: self.value(name) for name in self.upper_bounds}


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
