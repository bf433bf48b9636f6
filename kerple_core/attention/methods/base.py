"""The interface of an attention method, and its registry.

An attention method changes how a layer attends beyond the bias added to its logits: it acts on
the queries (before any backend sees them), on the logits (a score transform, which needs the
scores), or replaces the softmax by other weights. Each method is one module of this package with
a :func:`register_attention_method`-decorated :class:`AttentionMethod` subclass; its options are
copied into the model's configuration as the kernels' are, and everything that tells methods apart
(the backend's choice, the check of what composes, the cache, the analyses) reads the class's
declarations, never its name.
"""

import dataclasses
from typing import ClassVar, Dict, List, Optional, Type

from torch import Tensor, nn

from kerple_core.attention.blocks import QueryBlock
from kerple_core.errors import KernelConfigError
from kerple_core.kernels.registry import declared_fields, options_from, registrar
from kerple_core.visibility import Visibility

#: where a method acts: on the queries, on the logits of each block, or on the weights (instead of the softmax)
QUERIES, SCORES, WEIGHTS = "queries", "scores", "weights"
STAGES = (QUERIES, SCORES, WEIGHTS)

ATTENTION_METHODS: Dict[str, Type["AttentionMethod"]] = {}


class AttentionMethod(nn.Module):
    """One layer's attention method (one instance per layer, with that layer's parameters).

    A subclass declares ``options`` (a dataclass of its command-line options), ``switch`` (the option
    that turns it on: a flag, or a choice whose ``"none"`` is off), ``acts_on`` (one of
    :data:`STAGES`) and, for a method that keeps a state per key, ``cached_state`` (its name in the
    decoding cache, where it is trimmed and reordered with the keys), and implements the hook of its
    stage: :meth:`scale_queries`, :meth:`call_transforms` or :meth:`weights`.
    """

    name: ClassVar[str] = ""
    options: ClassVar[Optional[type]] = None
    switch: ClassVar[str] = ""
    acts_on: ClassVar[str] = SCORES
    cached_state: ClassVar[Optional[str]] = None
    #: it reads the number of keys a query sees: refused where a visibility rule limits them by position
    counts_keys_seen: ClassVar[bool] = False
    #: methods of one stage act in increasing ``precedence`` (ties: the registry's order)
    precedence: ClassVar[int] = 0

    @classmethod
    def needs_scores(cls) -> bool:
        """It reads the scores ``q k^T``: only the explicit backend serves it (read by ``choose_backend``)."""
        return cls.acts_on in (SCORES, WEIGHTS)

    @classmethod
    def rewrites_logits(cls) -> bool:
        """It replaces the logits: at most one such method (ReRoPE's merged logits among them) per layer."""
        return cls.acts_on == SCORES

    @classmethod
    def chosen(cls, cfg) -> bool:
        """``cfg`` turns the method on."""
        value = getattr(cfg, cls.switch, None)
        return bool(value) and str(value) != "none"

    @classmethod
    def acts_in_layer(cls, cfg, rotary: bool) -> bool:
        """Whether the method acts in a layer (with rotary embeddings or not) of a model whose ``cfg``
        turns it on: in every layer unless a method says otherwise."""
        return True

    #: where it acts, in words (a method that does not act in every layer): "acts in ..."
    layer_rule: ClassVar[str] = ""

    @classmethod
    def command_lines(cls) -> Dict[str, List[str]]:
        """The flags that turn the method on, by a label (a method with variants has one each)."""
        return {cls.name.replace("_", "-"): [f"--{cls.switch.replace('_', '-')}"]}

    @classmethod
    def build(cls, num_heads: int, head_dim: int, cfg) -> "AttentionMethod":
        """One layer's instance, its options read from ``cfg`` (missing or None: the default)."""
        return cls(num_heads, head_dim, **options_from(cls.options, cfg))

    # -- the hooks of each stage
    def scale_queries(self, q: Tensor, first_position: int, visibility: Visibility) -> Tensor:
        """``q`` ``[B, H, T, D]`` at absolute positions ``first_position ..`` (the keys each sees:
        ``visibility``), changed by the method."""
        raise NotImplementedError

    def scale_bias(self, bias, first_position: int, visibility: Visibility):
        """A block's bias as a query method leaves it (``bias.block``'s first query at absolute position
        ``first_position + bias.block.query_start``): unchanged, unless the method scales whole logits."""
        return bias

    def new_key_state(self, q: Tensor, k: Tensor, x: Tensor) -> Tensor:
        """The state ``[..., new keys]`` of the call's new keys, before they are attended (``cached_state``),
        from the call's queries and keys ``[B, H, T, D]`` (positioned) and the layer input ``x`` ``[T, B, E]``."""
        raise NotImplementedError

    def call_transforms(self, state: Optional[Tensor], first_key_position: int) -> "CallTransforms":
        """The score transforms of one call's blocks; ``state``: the cached state of every key of the
        call (``cached_state``), key 0 at absolute position ``first_key_position``."""
        return CallTransforms(self)

    def weights(self, logits: Tensor, block: QueryBlock) -> Tensor:
        """The weights ``[..., queries, keys]`` of a block from its logits, in place of the softmax."""
        raise NotImplementedError

    @classmethod
    def learned_values(cls, state: Dict[str, Tensor], prefix: str) -> Dict[str, Tensor]:
        """The learned per-head values an analysis reports, from a checkpoint's ``state`` whose keys of
        this layer's method start with ``prefix``; none by default."""
        return {}


class CallTransforms:
    """The score transform of each block of one call, in the order of their queries; ``state`` is the
    per-key state to cache after the call (a method with ``cached_state``)."""

    def __init__(self, method: AttentionMethod, state: Optional[Tensor] = None):
        self.method = method
        self.state = state

    def transform(self, block: QueryBlock):
        """``(q, scores, mask) -> logits`` of ``block``."""
        return self.method


#: class decorator: make an :class:`AttentionMethod` available by its name (its options on the command line)
register_attention_method = registrar(ATTENTION_METHODS, AttentionMethod, "attention method")


def attention_method_names() -> List[str]:
    return list(ATTENTION_METHODS)


def attention_method_option_fields() -> List[dataclasses.Field]:
    """Every option field declared by a registered attention method, each once."""
    return declared_fields(ATTENTION_METHODS.values())


def chosen_methods(cfg, extra=()) -> List[Type[AttentionMethod]]:
    """The methods ``cfg`` turns on, and those named in ``extra``, in the order they act."""
    for name in extra:
        if name not in ATTENTION_METHODS:
            raise KernelConfigError(f"unknown attention method {name!r}; choose one of: "
                                    f"{', '.join(attention_method_names())}")
    chosen = [cls for name, cls in ATTENTION_METHODS.items() if cls.chosen(cfg) or name in extra]
    return sorted(chosen, key=lambda cls: (STAGES.index(cls.acts_on), cls.precedence))


def layout(methods) -> Dict[str, str]:
    """Where each of a layer's ``methods`` (in order) is held in its attention module, by name: the
    query methods in ``query_scales.<i>``, the logits' method in ``score_transform``, the weights'
    in ``attention_weights`` (the prefix of its parameters in a checkpoint, after ``self_attn.``)."""
    queries = [m for m in methods if m.acts_on == QUERIES]
    places = {m.name: f"query_scales.{i}" for i, m in enumerate(queries)}
    places.update({m.name: "score_transform" if m.acts_on == SCORES else "attention_weights"
                   for m in methods if m.acts_on != QUERIES})
    return places
