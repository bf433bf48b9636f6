"""The attention backends, one module each, registered in the order ``--attention-backend auto`` tries them.

Every module of this package is imported here, so a new backend is one file with a
:func:`register_backend`-decorated :class:`AttentionBackend` subclass; :data:`ORDER` places the package's own, and
one of a plugin says which backend it comes before (:attr:`AttentionBackend.comes_before`).
"""

import importlib
import pkgutil

from kerple_core.attention.backends.base import (
    BACKENDS,
    AttentionBackend,
    AttentionCall,
    AttentionWeights,
    ScoreTransform,
    choices,
    choices_help,
    order,
    reference,
    register_backend,
)

#: ``auto``'s order: the explicit path first, where a block needs its scores or probabilities (it also serves every
#: block no other takes); then the fused Triton kernel, FlexAttention, SDPA's CPU kernel with the kernel parameters'
#: gradient from fused forwards, and SDPA
ORDER = ("explicit", "fused", "flex", "kernel gradient", "sdpa")

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
order(ORDER)

__all__ = ["BACKENDS", "ORDER", "AttentionBackend", "AttentionCall", "AttentionWeights", "ScoreTransform", "choices",
           "choices_help", "order", "reference", "register_backend"]
