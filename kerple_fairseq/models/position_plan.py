"""Per-layer position plans: ``--layer-positions`` gives each layer its own position encoding and
attention window, as hybrid designs do (e.g. rotary layers in a sliding window with a global NoPE layer
every fourth: ``rotary@128,rotary@128,rotary@128,nope``).

The plan is a comma-separated list of entries, repeated over the layers (layer ``n`` takes entry
``n mod len(plan)``). An entry is ``NAME[+NAME...][@WINDOW]``: at most one bias kernel or layer bias
(``--bias-kernel``'s names; none named: ``none``), ``rotary`` for rotary embeddings (with the model's
rotary options), ``nope`` for no position encoding, and any attention methods by name (in that layer
only, besides those the model's own flags turn on everywhere); ``@WINDOW``: the layer's attention
window (none: global). Every other option is the model's.
"""

from typing import List, NamedTuple, Tuple

from kerple_fairseq.models.position_methods import ATTENTION_METHOD, position_method
from kerple_fairseq.errors import KernelConfigError

ROTARY, NOPE = "rotary", "nope"


class LayerPositions(NamedTuple):
    """One entry of a plan: the layer's bias kernel (or layer bias), rotary or not, its own attention
    methods and its attention window (0: global)."""

    bias: str = "none"
    rotary: bool = False
    methods: Tuple[str, ...] = ()
    window: int = 0


def parse_plan(text: str) -> List[LayerPositions]:
    """The entries of ``--layer-positions`` (empty: no plan); a :class:`KernelConfigError` for a bad one."""
    text = (text or "").strip()
    return [parse_entry(entry.strip()) for entry in text.split(",")] if text else []


def parse_entry(entry: str) -> LayerPositions:
    names, _, window = entry.partition("@")
    if window:
        if not window.isdigit() or int(window) < 1:
            raise KernelConfigError(f"--layer-positions entry {entry!r}: the window after @ must be a whole number "
                                    "of keys >= 1 (leave it out for global attention)")
    if not names.strip():
        raise KernelConfigError(f"--layer-positions entry {entry!r} names no encoding: use nope for none")
    bias, rotary, methods = None, False, []
    for name in (n.strip() for n in names.split("+")):
        if name == ROTARY:
            rotary = True
        elif name != NOPE:
            kind, cls = position_method(name)
            if kind == ATTENTION_METHOD:
                methods.append(name)
            elif bias is not None:
                raise KernelConfigError(f"--layer-positions entry {entry!r} names two biases ({bias[0]} and "
                                        f"{name}); choose one per layer")
            else:
                bias = (name, cls)
    return LayerPositions(bias[0] if bias else "none", rotary, tuple(methods), int(window or 0))


def describe_entry(entry: LayerPositions) -> str:
    """``entry`` as a plan writes it (``NAME[+NAME...][@WINDOW]``)."""
    names = ([ROTARY] if entry.rotary else []) + ([] if entry.bias == "none" else [entry.bias]) + list(entry.methods)
    return "+".join(names or [NOPE]) + (f"@{entry.window}" if entry.window else "")


def layer_plan(text: str, num_layers: int) -> List[LayerPositions]:
    """Each layer's entry (the plan repeated over ``num_layers``); empty without a plan."""
    plan = parse_plan(text)
    return [plan[n % len(plan)] for n in range(num_layers)] if plan else []
