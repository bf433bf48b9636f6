"""What composes with what in one model: every rule, checked once before anything is built, from what
each position method declares (a kernel's, layer bias's or visibility rule's ``encodes_position``, an
attention method's ``acts_on``, ``rewrites_logits``, ``counts_keys_seen`` and ``acts_in_layer``, a
visibility's ``by_position``, a rotary scaling's ``plain_rotary_only`` and ``beyond_rotation``), each
broken rule one line saying what to change. The modules that build the model then build it without
checking it again; a rotary embedding applies the scalings' rule again (:func:`check_together`) when its
scaling is changed on a trained model at evaluation, and for a model built from the core alone."""

from typing import List, Optional, Sequence

from fairseq.utils import safe_getattr

from kerple_core.attention.methods import WEIGHTS, chosen_methods
from kerple_core.attention.rotary import RE_ROPE
from kerple_core.attention.rotary.scalings import check_together, chosen_scalings
from kerple_fairseq.errors import KernelConfigError
from kerple_fairseq.models.position_methods import VISIBILITY_RULE, position_method
from kerple_fairseq.models.position_plan import LayerPositions, describe_entry, parse_plan


def flag(switch: str) -> str:
    return f"--{switch.replace('_', '-')}"


def check_model(args) -> None:
    """Raise a :class:`KernelConfigError` for the first rule the model's options break."""
    plan = parse_plan(safe_getattr(args, "layer_positions", ""))
    check_one_source_of_position(args, plan)
    check_every_method_acts_somewhere(args, plan)
    for entry in plan or [None]:
        check_layer(args, entry)


def check_one_source_of_position(args, plan: Sequence[LayerPositions]) -> None:
    """One source of position: a distance-encoding kernel or layer bias, or token positions, or rotary; with
    ``--layer-positions``, each layer's from its entry, the model-wide ones left out."""
    token_positions = not args.no_token_positional_embeddings
    if plan:
        for option, value in (("--rotary-embeddings", args.rotary_embeddings), ("--attn-window", args.attn_window)):
            if value:
                raise KernelConfigError(f"--layer-positions names each layer's encoding and window: drop {option} "
                                        "(write rotary, or @WINDOW, in the plan's entries; --arch "
                                        "transformer_lm_kerple has neither on)")
    rotary = any(entry.rotary for entry in plan) if plan else args.rotary_embeddings
    for option, on in (("--rotary-xpos", safe_getattr(args, "rotary_xpos", False)),
                       ("--rotary-scaling", safe_getattr(args, "rotary_scaling", "none") != "none"),
                       ("--rotary-fraction", safe_getattr(args, "rotary_fraction", 1.0) != 1.0)):
        if on and not rotary:
            raise KernelConfigError(f"{option} changes rotary embeddings: add --rotary-embeddings "
                                    "(or use --arch transformer_lm_rotary)")
    if rotary:
        check_together(chosen_scalings(args, str(safe_getattr(args, "rotary_scaling", "none"))))
    if token_positions and rotary:
        raise KernelConfigError(
            "--token-positional-embeddings and --rotary-embeddings are two position encodings; "
            "choose one")
    for entry in plan:
        if entry.rotary and position_method(entry.bias).cls.encodes_position:
            raise KernelConfigError(f"--layer-positions entry {describe_entry(entry)!r}: {entry.bias} already "
                                    "encodes position; rotary goes with none or window only")
    for bias in [entry.bias for entry in plan] or [args.bias_kernel]:
        if position_method(bias).cls.encodes_position and (token_positions or (args.rotary_embeddings and not plan)):
            which = "rotary embeddings" if args.rotary_embeddings else "token positional embeddings"
            option = "--rotary-embeddings" if args.rotary_embeddings else \
                "--token-positional-embeddings (on in the transformer_lm_sinusoidal and transformer_lm_learned_pos " \
                "architectures: train a kernel on transformer_lm_kerple)"
            raise KernelConfigError(
                f"--bias-kernel {bias} already encodes position, but {which} are on as "
                f"well; drop {option}, or use --bias-kernel none (or window) for a positional baseline"
            )


def layer_methods(args, entry: Optional[LayerPositions]) -> List[type]:
    """The attention methods that act in a layer of ``entry`` (None: every layer of a model without a plan)."""
    rotary = layer_rotary(args, entry)
    return [m for m in chosen_methods(args, () if entry is None else entry.methods) if m.acts_in_layer(args, rotary)]


def layer_rotary(args, entry: Optional[LayerPositions]) -> bool:
    return safe_getattr(args, "rotary_embeddings", False) if entry is None else entry.rotary


def check_layer(args, entry: Optional[LayerPositions]) -> None:
    """The methods a plan names act where it names them; a method that counts the keys a query sees never
    goes with a visibility rule of positions; at most one rewrite of the logits (the methods', ReRoPE's)
    and one replacement of the softmax."""
    rotary = layer_rotary(args, entry)
    for method in chosen_methods(args, () if entry is None else entry.methods):
        if entry is not None and method.name in entry.methods and not method.acts_in_layer(args, rotary):
            raise KernelConfigError(f"--layer-positions names {method.name} in a layer where it does not act: it "
                                    f"{method.layer_rule}")
    methods = layer_methods(args, entry)
    bias = args.bias_kernel if entry is None else entry.bias
    if position_method(bias).kind == VISIBILITY_RULE:
        counting = [flag(m.switch) for m in methods if m.counts_keys_seen]
        if counting:
            raise KernelConfigError(f"{' and '.join(counting)} counts the keys each query sees, which "
                                    f"{bias} attention limits by position: not supported together")
    rotary_scaling = str(safe_getattr(args, "rotary_scaling", "none"))
    rewrites = [flag(m.switch) for m in methods if m.rewrites_logits()]
    rewrites += [f"--rotary-scaling {rotary_scaling}"] if rotary and rotary_scaling in RE_ROPE else []
    if len(rewrites) > 1:
        raise KernelConfigError(f"{' and '.join(rewrites)} each rewrite the attention logits; choose one")
    weights = [flag(m.switch) for m in methods if m.acts_on == WEIGHTS]
    if len(weights) > 1:
        raise KernelConfigError(f"{' and '.join(weights)} each replace the softmax; choose one")


def check_every_method_acts_somewhere(args, plan: Sequence[LayerPositions]) -> None:
    rotary_layers = [entry.rotary for entry in plan] or [safe_getattr(args, "rotary_embeddings", False)]
    for method in chosen_methods(args):
        if not any(method.acts_in_layer(args, rotary) for rotary in rotary_layers):
            raise KernelConfigError(f"this model has no layer where {flag(method.switch)} acts: it "
                                    f"{method.layer_rule}")
