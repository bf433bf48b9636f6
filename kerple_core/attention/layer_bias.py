"""A block's distance bias plus the bias one layer builds for itself."""

from typing import Optional

import torch
from torch import Tensor

from kerple_core.attention import flex
from kerple_core.attention.block_bias import BlockBias
from kerple_core.attention.distance_bias import DistanceBlockBias
from kerple_core.precision import precise


class BlockBiasOnTop(BlockBias):
    """A block's bias built on another's (``base``): the same block, weight and block mask; never given
    to the kernel gradient backend (it has no per-distance values), and FlexAttention serves it as it
    serves a layer's own term; its term reads the model's tensors unless a subclass knows otherwise (on
    CUDA, FlexAttention then serves it only without gradients)."""

    has_layer_term = True
    term_reads_model_tensors = True

    def __init__(self, base: BlockBias):
        self.base = base

    @property
    def block(self):
        return self.base.block

    @property
    def has_weight(self) -> bool:
        return self.base.has_weight

    def weight(self, dtype: torch.dtype, device) -> Optional[Tensor]:
        return self.base.weight(dtype, device)

    def block_mask(self, device, key_padding_mask: Optional[Tensor] = None):
        return self.base.block_mask(device, key_padding_mask)


class LayerBlockBias(BlockBiasOnTop):
    """The bias of one block of queries: the distance bias (causal mask, any attention window, the
    distance kernel) plus a layer's own bias (:class:`~kerple_core.layer_biases.LayerBias`),
    summed in float32 and cast once, or, for FlexAttention, added as the layer's score term. Offers
    what the backends ask of a :class:`DistanceBlockBias`; having no per-distance values, it is never
    given to the kernel gradient backend. ``first_position`` and ``state`` are what
    :meth:`~kerple_core.layer_biases.LayerBias.block_bias` takes."""

    def __init__(self, base: DistanceBlockBias, layer_bias, first_position: int, state: Optional[Tensor]):
        super().__init__(base)
        self.layer_bias = layer_bias
        self.first_position = first_position
        self.state = state

    @property
    def only_masks(self) -> bool:
        """Both biases are 0 wherever they are finite."""
        return self.base.only_masks and not self.layer_bias.encodes_position

    @property
    def has_state_difference(self) -> bool:
        """The layer's term is ``state[query] - state[key]`` of its per-key state (the Forgetting Transformer's),
        which a backend may read as :meth:`state_difference`."""
        return self.layer_bias.term_is_state_difference

    def state_difference(self) -> Tensor:
        """``[batch, heads, keys]``: the state of the block's keys; query ``t`` reads key ``offset + t``'s."""
        return self.state[:, :, self.block.key_start:self.block.key_end]

    def mask(self, dtype: torch.dtype, device) -> Tensor:
        """``[heads, queries, keys]`` or ``[batch, heads, queries, keys]``: both biases, ``-inf``
        for keys a query may not see."""
        computed = precise(dtype)
        layer = self.layer_bias.block_bias(self.block, self.first_position, self.state)
        return (self.base.mask(computed, device) + layer).to(dtype)

    def score_mod(self, dtype: torch.dtype, device) -> flex.ScoreMod:
        return flex.plus(self.base.score_mod(dtype, device),
                         self.layer_bias.score_term(self.block, self.first_position, self.state))
