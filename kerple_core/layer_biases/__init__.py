"""Per-layer attention biases: methods whose bias is not one function of the distance shared by
every layer, but is built by each layer for itself (FIRE: from the query's position too; the
Forgetting Transformer: from the layer's input). Chosen with ``--bias-kernel`` like the kernels of
:mod:`kerple_core.kernels`; every module of this package is imported here.
"""

import importlib
import pkgutil

from kerple_core.layer_biases.base import (
    LAYER_BIASES,
    LayerBias,
    build_layer_bias,
    layer_bias_names,
    layer_bias_option_fields,
    register_layer_bias,
)

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["LAYER_BIASES", "LayerBias", "build_layer_bias", "layer_bias_names", "layer_bias_option_fields",
           "register_layer_bias"]
