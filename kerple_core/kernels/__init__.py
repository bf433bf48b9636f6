"""Positional attention-bias kernels, one module per kernel.

Every module in this package is imported here, so a new kernel is one file with
a :func:`register_kernel`-decorated :class:`BiasKernel` subclass.
"""

import importlib
import pkgutil

from kerple_core.kernels.base import BiasKernel
from kerple_core.kernels.registry import (
    KERNELS,
    build_kernel,
    kernel_names,
    option_fields,
    register_kernel,
)

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["BiasKernel", "KERNELS", "build_kernel", "kernel_names", "option_fields", "register_kernel"]
