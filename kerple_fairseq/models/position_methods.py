"""One lookup of a position method by name, over the four registries: distance kernels
(:mod:`kerple_core.kernels`), biases each layer builds (:mod:`kerple_core.layer_biases`) and rules of
which keys a query sees (:mod:`kerple_core.visibility`), all three chosen with ``--bias-kernel``, and
attention methods (:mod:`kerple_core.attention.methods`), each with its own switch. A name is registered
once over all four."""

from typing import Dict, List, NamedTuple

from kerple_core.attention.methods import ATTENTION_METHODS
from kerple_fairseq.errors import KernelConfigError
from kerple_core.kernels import KERNELS
from kerple_core.layer_biases import LAYER_BIASES
from kerple_core.visibility import VISIBILITY_RULES

KERNEL, LAYER_BIAS, VISIBILITY_RULE, ATTENTION_METHOD = "bias kernel", "layer bias", "visibility rule", "attention method"
REGISTRIES: Dict[str, Dict[str, type]] = {KERNEL: KERNELS, LAYER_BIAS: LAYER_BIASES, VISIBILITY_RULE: VISIBILITY_RULES,
                                          ATTENTION_METHOD: ATTENTION_METHODS}
PLURALS = {KERNEL: "bias kernels", LAYER_BIAS: "layer biases", VISIBILITY_RULE: "visibility rules",
           ATTENTION_METHOD: "attention methods"}


class PositionMethod(NamedTuple):
    kind: str  # KERNEL, LAYER_BIAS or ATTENTION_METHOD
    cls: type


def bias_names() -> List[str]:
    """What ``--bias-kernel`` takes: every distance kernel, layer bias and visibility rule."""
    return sorted([*KERNELS, *LAYER_BIASES, *VISIBILITY_RULES])


def position_method(name: str) -> PositionMethod:
    """The registered method ``name``, whichever registry holds it; a :class:`KernelConfigError`
    naming every choice for anything else."""
    found = [PositionMethod(kind, registry[name]) for kind, registry in REGISTRIES.items() if name in registry]
    if len(found) > 1:
        raise KernelConfigError(f"{name!r} is registered as {' and as '.join(f.kind for f in found)}")
    if not found:
        raise KernelConfigError(f"unknown position method {name!r}; choose one of the {choices()}")
    return found[0]


def choices() -> str:
    """Every registered name, by registry: ``bias kernels: alibi, ...; layer biases: ...; attention methods: ...``."""
    return "; ".join(f"{PLURALS[kind]}: {', '.join(sorted(registry))}" for kind, registry in REGISTRIES.items())
