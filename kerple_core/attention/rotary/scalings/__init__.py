"""Rotary scalings, one module per scaling (NTK-aware, dynamic NTK, YaRN, ReRoPE and leaky ReRoPE, xPos,
p-RoPE).

Every module of this package is imported here, so a new scaling is one file with a
:func:`register_rotary_scaling`-decorated :class:`RotaryScaling` subclass.
"""

import importlib
import pkgutil

from kerple_core.attention.rotary.scalings.base import (
    ROTARY_SCALING_CLASSES,
    RotaryScaling,
    by_precedence,
    check_together,
    chosen_scalings,
    register_rotary_scaling,
)

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["ROTARY_SCALING_CLASSES", "RotaryScaling", "by_precedence", "check_together", "chosen_scalings",
           "register_rotary_scaling"]
