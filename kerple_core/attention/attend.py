"""How one block of queries is attended: the attention math, apart from the module.

:func:`attend` takes a block's queries, keys and values and what biases its scores (a
:class:`~kerple_core.attention.block_bias.BlockBias`, which lays out the bias, and the
weight of a weight kernel, only when a backend asks) and gives it to the first backend, in ``auto``'s order, that
takes it, or to the one asked for (``--attention-backend``); each backend is a module of its own
(:mod:`kerple_core.attention.backends`). One that
``auto`` chose and that fails to build on this machine is set aside, and the block goes to the next.

Dense attention, incremental decoding and long sequences differ only in their blocks
(:mod:`kerple_core.attention.blocks`); every backend gives the same result.

Other methods plug in as follows:

- a **bias built by each layer** (:mod:`kerple_core.layer_biases`: FIRE from the absolute
  positions of the block's queries and keys, the Forgetting Transformer from the layer's input)
  is added to the block's distance bias by :class:`~kerple_core.attention.layer_bias.LayerBlockBias`,
  ``[heads, ...]`` or ``[batch, heads, ...]`` (or as a score term for FlexAttention);
- an **attention method** (:mod:`kerple_core.attention.methods`) acts on the queries before any
  backend sees them (scalable softmax, Llama 4's temperature), or needs the scores: a score transform
  (DAPE, CoPE, selective attention, PaTH, and ReRoPE's merged logits from
  :mod:`kerple_core.attention.rotary`) or weights in place of the softmax (stick-breaking), which
  run on the explicit backend, one block at a time.

An :class:`AttentionRecord` given to :func:`attend` counts the backends chosen and keeps the logits.
"""

from collections import Counter
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from torch import Tensor

from kerple_core.attention.backends import (BACKENDS as REGISTERED, AttentionBackend, AttentionCall,
                                            AttentionWeights, ScoreTransform, choices, reference)
from kerple_core.attention.block_bias import BlockBias
from kerple_core.errors import KernelConfigError

#: ``--attention-backend`` choices: ``auto`` and the registered backends asked for by name, in ``auto``'s order
BACKENDS = choices()


@dataclass
class AttentionRecord:
    """What attention did while the record was given to it: the backend of each block and, with
    ``keep_logits``, the logits of each block attended (every block then on the explicit backend);
    :func:`~kerple_core.attention.self_attention.recorded` lays them out per call, with its
    probabilities."""

    keep_logits: bool = False
    backends: Counter = field(default_factory=Counter)
    logits: List[Tensor] = field(default_factory=list)
    probabilities: List[Tensor] = field(default_factory=list)


def asked_backend(preference: str, device) -> Optional[AttentionBackend]:
    """The backend ``--attention-backend preference`` names (None for ``auto``); one that cannot run on ``device``
    at all is refused in one line (:class:`KernelConfigError`)."""
    if preference not in BACKENDS:
        raise ValueError(f"unknown attention backend {preference!r}; choose one of: {', '.join(BACKENDS)}")
    if preference == "auto":
        return None
    asked = REGISTERED[preference]
    why = asked.unavailable(device)
    if why:
        raise KernelConfigError(why)
    return asked


def chosen(call: AttentionCall, set_aside=()) -> AttentionBackend:
    """The first registered backend that takes the block, in ``auto``'s order (leaving out those ``set_aside``),
    or the one that serves every block."""
    return next((b for b in REGISTERED.values() if b not in set_aside and b.takes(call)), None) or reference()


def choose_backend(q: Tensor, k: Tensor, bias: BlockBias, *, preference: str = "auto", dropout: float,
                   key_padding_mask: Optional[Tensor], need_probabilities: bool, needs_scores: bool = False) -> str:
    """The name of the backend that attends a block (:func:`chosen`)."""
    return chosen(AttentionCall(q, k, None, bias, dropout, key_padding_mask, need_probabilities, needs_scores,
                                asked_backend(preference, q.device))).name


def attend(q: Tensor, k: Tensor, v: Tensor, bias: BlockBias, *, preference: str = "auto",
           dropout: float = 0.0, key_padding_mask: Optional[Tensor] = None, need_probabilities: bool = False,
           score_transform: Optional[ScoreTransform] = None, weights: Optional[AttentionWeights] = None,
           record: Optional[AttentionRecord] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """Attention of one block: ``q`` ``[B, H, T, D]`` (already scaled by ``1/sqrt(D)``), ``k`` and
    ``v`` ``[B, H, S, D]`` (the block's keys), ``key_padding_mask`` ``[B, S]`` (True: padding);
    ``weights``: the weights from the logits instead of the softmax.
    Returns the attended values ``[B, H, T, D]`` and, with ``need_probabilities``, the float32
    probabilities ``[B, H, T, S]``. A backend ``auto`` chose that fails to build on this machine is set aside
    and the block chosen again; asked for by name, its error is raised."""
    call = AttentionCall(q, k, v, bias, dropout, key_padding_mask, need_probabilities,
                         score_transform is not None or weights is not None, asked_backend(preference, q.device),
                         score_transform, weights, record.logits if record is not None and record.keep_logits else None)
    set_aside = []
    while True:
        backend = chosen(call, set_aside)
        try:
            attended = backend.attend(call)
        except backend.build_errors() as error:
            if call.asked is backend or backend.serves_every_block:
                raise
            backend.set_aside(error)  # the other backends serve from now on
            set_aside.append(backend)
            continue
        if record is not None:
            record.backends[backend.name] += 1
        return attended
