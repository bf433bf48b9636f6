"""The interface of a bias that each attention layer builds for itself, and its registry."""

import dataclasses
import itertools
from typing import ClassVar, Dict, List, Optional, Type

import torch
from torch import Tensor, nn

from kerple_core.attention.blocks import QueryBlock
from kerple_core.errors import KernelConfigError
from kerple_core.kernels.registry import declared_fields, options_from, registrar

LAYER_BIASES: Dict[str, Type["LayerBias"]] = {}


class LayerBias(nn.Module):
    """A bias added to one layer's scaled logits, with parameters of that layer alone.

    Unlike a :class:`~kerple_core.kernels.BiasKernel` it may depend on the absolute
    position of the query and on the layer's input. A subclass defines it once, cell by cell, as a
    term of the block's indices (:meth:`score_term`), which FlexAttention reads inside its kernel and
    from which :meth:`block_bias` lays out a block for the other backends. Attention asks for it one
    block of queries at a time; the causal mask and any attention window are applied by the
    attention module, so only the cells a query may see matter.

    A bias that depends on the input keeps a per-key state: :meth:`key_state` gives it for
    the new positions of a call from the layer's input and the state of the positions
    before them (cached during incremental decoding beside the keys, trimmed with them and
    reordered with them by beam search). A subclass sets ``options`` to a dataclass of its
    command-line options (fields become ``--dashed-flags``).
    """

    name: ClassVar[str] = ""
    options: ClassVar[Optional[type]] = None
    #: the bias tells positions apart (True for every layer bias here)
    encodes_position: ClassVar[bool] = True
    #: the distance kernel (with the causal mask and any window) this bias is added to
    distance_kernel: ClassVar[str] = "none"
    #: the constructor takes ``train_length``, the model's ``--tokens-per-sample``
    needs_train_length: ClassVar[bool] = False
    #: :meth:`score_term` is ``state[query] - state[key]`` of :meth:`key_state` (query ``t`` of a block being
    #: key ``offset + t``): a backend may read the state instead of the term
    term_is_state_difference: ClassVar[bool] = False

    def __init__(self, num_heads: int, embed_dim: int):
        super().__init__()
        if num_heads < 1:
            raise KernelConfigError(f"the number of attention heads must be >= 1, got {num_heads}")
        self.num_heads = num_heads
        self.embed_dim = embed_dim

    def key_state(self, x: Tensor, previous: Optional[Tensor]) -> Optional[Tensor]:
        """``[batch, heads, new positions]`` float32 state of the call's new positions from the
        layer input ``x`` ``[new positions, batch, embed_dim]`` and ``previous``, the state of the
        positions before them (None at the start); None for a bias without state."""
        return None

    def score_term(self, block: QueryBlock, first_position: int, state: Optional[Tensor]):
        """The bias of one block as a term ``(batch, head, query, key) -> bias`` of the indices of a cell
        (FlexAttention's form), over captured tensors (never a 0-d one), in float32 (float64 in a float64
        module), written with operations that broadcast, so that the same term gives every cell at once.
        Query ``t`` of the block is at absolute position ``first_position + block.query_start + t`` and is
        ``block.offset + t - s`` positions after key ``s``; ``state`` is :meth:`key_state` of every key of
        the call (None for a bias without state)."""
        raise NotImplementedError

    def block_bias(self, block: QueryBlock, first_position: int, state: Optional[Tensor]) -> Tensor:
        """The bias of one block laid out, ``[heads, queries, keys]`` (``[batch, heads, queries, keys]``
        with a state): :meth:`score_term` at every cell, its indices broadcast against each other. Values
        at keys a query may not see are ignored."""
        device = next(itertools.chain(self.parameters(), self.buffers())).device
        batch = 1 if state is None else state.size(0)
        cells = (batch, self.num_heads, block.num_queries, block.num_keys)
        indices = [torch.arange(n, device=device).view([-1 if d == i else 1 for d in range(4)])
                   for i, n in enumerate(cells)]
        bias = self.score_term(block, first_position, state)(*indices).expand(cells)
        return bias if state is not None else bias[0]

    #: :meth:`curves` needs the layer's inputs (the bias depends on content)
    curves_need_inputs: ClassVar[bool] = False

    def curves(self, max_distance: int, inputs: Optional[Tensor] = None) -> Tensor:
        """``[heads, max_distance + 1]`` float32: the bias on a key ``d = 0 .. max_distance`` positions
        before a query, as the analyses draw a kernel; ``inputs`` ``[T, batch, embed_dim]``: inputs of
        the layer, for a bias that depends on them."""
        raise NotImplementedError

    def curves_description(self, max_distance: int) -> str:
        """What :meth:`curves` shows, for figure titles."""
        return ""

    def extra_repr(self) -> str:
        return f"{self.name}, heads={self.num_heads}"


#: class decorator: make a :class:`LayerBias` available as ``--bias-kernel NAME``
register_layer_bias = registrar(LAYER_BIASES, LayerBias, "layer bias")


def layer_bias_names() -> List[str]:
    return sorted(LAYER_BIASES)


def build_layer_bias(name: str, num_heads: int, embed_dim: int, cfg=None) -> LayerBias:
    """Instantiate layer bias ``name`` for one layer, reading its options from ``cfg`` (missing or
    None options take the dataclass default)."""
    if name not in LAYER_BIASES:
        raise KernelConfigError(f"unknown layer bias {name!r}; choose one of: {', '.join(layer_bias_names())}")
    cls = LAYER_BIASES[name]
    kwargs = options_from(cls.options, cfg)
    if cls.needs_train_length:
        kwargs["train_length"] = getattr(cfg, "tokens_per_sample", None)
    return cls(num_heads, embed_dim, **kwargs)


def layer_bias_option_fields() -> List[dataclasses.Field]:
    """Every option field declared by a registered layer bias, each once."""
    return declared_fields(LAYER_BIASES[name] for name in layer_bias_names())
