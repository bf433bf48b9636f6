"""One lookup of a position method by name, over the three registries: distance kernels
(:mod:`kerple_core.kernels`), biases each layer builds (:mod:`kerple_core.layer_biases`), both
chosen with ``--bias-kernel``, and attention methods (:mod:`kerple_core.attention.methods`), each
with its own switch. A name is registered once over all three."""

from typing import Dict, List, NamedTuple

from kerple_core.attention.methods import ATTENTION_METHODS
from kerple_fairseq.errors import KernelConfigError
from kerple_core.kernels import KERNELS
from kerple_core.layer_biases import LAYER_BIASES

KERNEL, LAYER_BIAS, ATTENTION_METHOD = "bias kernel", "layer bias", "attention method"
REGISTRIES: Dict[str, Dict[str, type]] = {KERNEL: KERNELS, LAYER_BIAS: LAYER_BIASES, ATTENTION_METHOD: ATTENTION_METHODS}
PLURALS = {KERNEL: "bias kernels", LAYER_BIAS: "layer biases", ATTENTION_METHOD: "attention methods"}


class PositionMethod(NamedTuple):
    kind: str  # KERNEL, LAYER_BIAS or ATTENTION_METHOD
    cls: type


def bias_names() -> List[str]:
    """What ``--bias-kernel`` takes: every distance kernel and layer bias."""
    return sorted([*KERNELS, *LAYER_BIASES])


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
