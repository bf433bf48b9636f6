"""What an attention backend is, and the registry of them in the order ``--attention-backend auto`` tries them.

A backend is one module of :mod:`kerple_core.attention.backends` that registers one :class:`AttentionBackend`
(``@register_backend("name")``): whether it takes a block (:meth:`AttentionBackend.takes`, given the block's
:class:`AttentionCall`, which carries the backend asked for), how it attends it, and, where it cannot run on a device
at all, why (the one-line refusal of ``--attention-backend NAME``). The package puts them in the order ``auto``
tries them (:func:`order`); :func:`kerple_core.attention.attend.attend` walks it, and the ``--attention-backend``
choices, the record of the backends used and the docs' list derive from it. Where no backend takes a block, the one
that serves every block (:attr:`AttentionBackend.serves_every_block`, the explicit path) does.
"""

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple, Type

import torch
from torch import Tensor

from kerple_core.kernels.registry import registrar

#: ``transform(q, scores, bias)``: the logits from the block's queries, scores and bias (DAPE, CoPE)
ScoreTransform = Callable[[Tensor, Tensor, Tensor], Tensor]
#: ``weights(logits, block)``: the block's attention weights, in place of the softmax (stick-breaking)
AttentionWeights = Callable[[Tensor, object], Tensor]


@dataclass(frozen=True)
class AttentionCall:
    """One block to attend: ``q`` ``[B, H, T, D]`` (already scaled by ``1/sqrt(D)``), ``k`` and ``v`` ``[B, H, S,
    D]``, its ``bias`` (a :class:`~kerple_core.attention.block_bias.BlockBias`), attention ``dropout``,
    ``key_padding_mask`` ``[B, S]`` (True: padding), whether the probabilities are returned, a score transform or
    weights in place of the softmax (an attention method that needs the scores), and the backend ``asked`` for
    (None: ``auto``). ``v`` is None where only the choice is made."""

    q: Tensor
    k: Tensor
    v: Optional[Tensor]
    bias: object
    dropout: float
    key_padding_mask: Optional[Tensor]
    need_probabilities: bool
    needs_scores: bool
    asked: Optional["AttentionBackend"]
    score_transform: Optional[ScoreTransform] = None
    weights: Optional[AttentionWeights] = None
    #: where the explicit path appends the logits of each block it attends (an attention record's), if kept
    logits_kept: Optional[list] = None

    @property
    def returns_values_only(self) -> bool:
        """Neither the probabilities nor the scores are needed: every backend may serve it."""
        return not (self.need_probabilities or self.needs_scores)

    @property
    def through_a_mask(self) -> bool:
        """Only the values needed, without key padding or a weight kernel: what a 4-D additive mask serves."""
        return self.returns_values_only and self.key_padding_mask is None and not self.bias.has_weight

    def asked_for_a_later_backend(self, backend: "AttentionBackend") -> bool:
        """A backend tried after ``backend`` was asked for (``auto`` then leaves ``backend`` out)."""
        order = list(BACKENDS.values())
        return self.asked is not None and order.index(self.asked) > order.index(backend)


class AttentionBackend:
    """One way of attending a block. :meth:`takes` and :meth:`attend` are each backend's own; a backend that can
    fail to build on a machine names the errors (:meth:`build_errors`), and ``auto`` then sets it aside
    (:meth:`set_aside`) and chooses again."""

    #: its ``--attention-backend`` name (set by ``register_backend``)
    name: str = ""
    #: what it is and where ``auto`` takes it, for ``--attention-backend``'s help (one clause)
    summary: str = ""
    #: ``--attention-backend`` may ask for it by name
    nameable: bool = True
    #: it serves every block: the one taken where no other takes a block
    serves_every_block: bool = False
    #: a backend outside the package's order (a plugin's): the backend ``auto`` tries just after it
    comes_before: Optional[str] = None

    def unavailable(self, device: torch.device) -> Optional[str]:
        """Why it cannot run on ``device`` at all, and what to do (one line), or None where it can."""
        return None

    def takes(self, call: AttentionCall) -> bool:
        """It attends ``call`` when the walk over the registry reaches it: where it serves the block and, unless it
        was asked for, where ``auto`` prefers it."""
        raise NotImplementedError

    def attend(self, call: AttentionCall) -> Tuple[Tensor, Optional[Tensor]]:
        """The attended values ``[B, H, T, D]`` and, where ``call.need_probabilities``, the float32 probabilities
        ``[B, H, T, S]`` (else None)."""
        raise NotImplementedError

    def build_errors(self) -> tuple:
        """The errors of building or launching it on this machine, which ``auto`` answers by setting it aside."""
        return ()

    def set_aside(self, error: Exception) -> None:
        """Take no more blocks in this process: it failed to build or launch here."""


#: the backend classes by name, as registered
REGISTERED: Dict[str, Type[AttentionBackend]] = {}
#: class decorator: make an :class:`AttentionBackend` available as ``--attention-backend NAME``
register_backend = registrar(REGISTERED, AttentionBackend, "attention backend")
#: the backends by name, in the order ``auto`` tries them (:func:`order`)
BACKENDS: Dict[str, AttentionBackend] = {}


def order(names) -> None:
    """Puts one of each registered backend in :data:`BACKENDS`, in ``auto``'s order: those ``names`` lists in its
    order, then each other one just before the backend its :attr:`~AttentionBackend.comes_before` names (at the end
    without one)."""
    unknown = [name for name in names if name not in REGISTERED]
    if unknown:
        raise ValueError(f"the order of the attention backends names unregistered ones: {', '.join(unknown)}")
    ordered = list(names)
    for name, cls in REGISTERED.items():
        if name not in names:
            if cls.comes_before is not None and cls.comes_before not in ordered:
                raise ValueError(f"attention backend {name!r} is to come before {cls.comes_before!r}, "
                                 "which is not registered")
            ordered.insert(len(ordered) if cls.comes_before is None else ordered.index(cls.comes_before), name)
    kept = dict(BACKENDS)
    BACKENDS.clear()
    BACKENDS.update((name, kept.get(name) or REGISTERED[name]()) for name in ordered)


def choices() -> Tuple[str, ...]:
    """``--attention-backend``'s choices: ``auto``, then the backends asked for by name, in their order."""
    return ("auto", *(name for name, backend in BACKENDS.items() if backend.nameable))


def choices_help() -> str:
    """``--attention-backend``'s help: each backend with its summary, in ``auto``'s order."""
    named = "; ".join(f"{name}{'' if backend.nameable else ' (not asked for by name)'}: {backend.summary}"
                      for name, backend in BACKENDS.items())
    return (f"how attention is computed: {named}. auto: the first of these, in this order, that takes each block "
            "(a backend asked for takes every block it serves; the others go on as with auto)")


def reference() -> AttentionBackend:
    """The backend that serves every block."""
    return next(backend for backend in BACKENDS.values() if backend.serves_every_block)
