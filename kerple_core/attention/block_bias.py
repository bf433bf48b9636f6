"""What one block of queries adds to its scores, in the forms the backends read it.

Every bias attention is given is a :class:`BlockBias`: a distance kernel's
(:class:`~kerple_core.attention.distance_bias.DistanceBlockBias`), the same plus a layer's own term
(:class:`~kerple_core.attention.layer_bias.LayerBlockBias`), either with its rows scaled
(:class:`~kerple_core.attention.scaled_bias.RowScaledBlockBias`). The explicit path and SDPA read it laid
out (:meth:`BlockBias.mask`, :meth:`BlockBias.weight`), FlexAttention as a score modification and a block
mask of tiles (:meth:`BlockBias.score_mod`, :meth:`BlockBias.block_mask`), and the kernel gradient backend
as per-distance values, which only a distance kernel's has. The class attributes say what a backend must
know before it takes one (:func:`~kerple_core.attention.attend.choose_backend`).
"""

import abc
from typing import Optional

import torch
from torch import Tensor

from kerple_core.attention import flex
from kerple_core.attention.blocks import QueryBlock


class BlockBias(abc.ABC):
    """The bias of one block of queries (``block``): ``[heads, queries, keys]`` or ``[batch, heads,
    queries, keys]``, ``-inf`` where a query may not see a key; for a weight kernel also the multipliers
    of the scaled logits."""

    block: QueryBlock
    #: multipliers of the scaled logits come with it (:meth:`weight`)
    has_weight: bool = False
    #: a layer's own term is in it (PyTorch 2.13's CPU compiler fails on some FlexAttention terms)
    has_layer_term: bool = False
    #: its score modification reads the model's tensors, parameters or a state (PyTorch 2.11 compiles no
    #: FlexAttention backward for some such terms on CUDA)
    term_reads_model_tensors: bool = False
    #: it is 0 wherever it is finite (no bias, a window, a mask of positions): scaling it changes nothing
    only_masks: bool = False

    @abc.abstractmethod
    def mask(self, dtype: torch.dtype, device) -> Tensor:
        """The bias laid out, in ``dtype``: ``-inf`` for keys a query may not see."""

    def weight(self, dtype: torch.dtype, device) -> Optional[Tensor]:
        """The multipliers of the scaled logits laid out (0 for keys a query may not see), or None."""
        return None

    @abc.abstractmethod
    def score_mod(self, dtype: torch.dtype, device) -> flex.ScoreMod:
        """FlexAttention's score modification: the bias read cell by cell, never laid out."""

    @abc.abstractmethod
    def block_mask(self, device, key_padding_mask: Optional[Tensor] = None) -> flex.Mask:
        """FlexAttention's block mask of the block: its tiles, and which keys each query sees within them."""
