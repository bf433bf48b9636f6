"""Which keys each query sees: the rules, one module per named rule, and a layer's :class:`Visibility`.

Every module in this package is imported here, so a new rule is one file with a
:func:`register_visibility_rule`-decorated :class:`VisibilityRule` subclass.
"""

import importlib
import pkgutil

from kerple_core.visibility.base import (GLOBAL, VISIBILITY_RULES, Visibility, VisibilityRule,
                                         build_visibility_rule, register_visibility_rule,
                                         visibility_rule_option_fields)

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["GLOBAL", "VISIBILITY_RULES", "Visibility", "VisibilityRule", "build_visibility_rule",
           "register_visibility_rule", "visibility_rule_option_fields"]
