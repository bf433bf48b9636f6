"""Attention methods, one module per method (DAPE, CoPE, selective attention, stick-breaking, scalable
softmax, Llama 4's attention temperature, SWAN-GPT's scaling, PaTH).

Every module of this package is imported here, so a new method is one file with a
:func:`register_attention_method`-decorated :class:`AttentionMethod` subclass.
"""

import importlib
import pkgutil

from kerple_core.attention.methods.base import (
    ATTENTION_METHODS,
    QUERIES,
    SCORES,
    STAGES,
    WEIGHTS,
    AttentionMethod,
    CallTransforms,
    attention_method_names,
    attention_method_option_fields,
    chosen_methods,
    layout,
    register_attention_method,
)

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["ATTENTION_METHODS", "QUERIES", "SCORES", "STAGES", "WEIGHTS", "AttentionMethod", "CallTransforms",
           "attention_method_names", "attention_method_option_fields", "chosen_methods",
           "layout", "register_attention_method"]
