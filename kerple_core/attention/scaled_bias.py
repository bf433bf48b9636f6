"""A block's bias with each query's row multiplied by a factor of its own (scalable softmax on the whole logit)."""

import torch
from torch import Tensor

from kerple_core.attention import flex
from kerple_core.attention.layer_bias import BlockBiasOnTop
from kerple_core.precision import precise


class RowScaledBlockBias(BlockBiasOnTop):
    """The bias of one block of queries (a :class:`~kerple_core.attention.distance_bias.DistanceBlockBias`
    or a layer's :class:`~kerple_core.attention.layer_bias.LayerBlockBias`) with row ``t`` of head ``h``
    multiplied by ``factor[h, t]`` (``[heads, block queries]``): laid out in float32 and cast once, ``-inf``
    kept where a query may not see a key (whatever the factor's sign, 0 included); for FlexAttention, the
    additive terms of the score modification scaled alike. A weight multiplies the scores as before.
    FlexAttention serves it where it serves a layer's own bias (PyTorch 2.13's CPU compiler fails on its
    score modification too: a C++ compile error, measured)."""

    def __init__(self, base, factor: Tensor):
        super().__init__(base)
        self.factor = factor

    @property
    def only_masks(self) -> bool:
        return self.base.only_masks

    def mask(self, dtype: torch.dtype, device) -> Tensor:
        computed = precise(dtype)
        mask = self.base.mask(computed, device)
        hidden = mask.isneginf()
        # the hidden cells zeroed before the product: -inf times the factor would make its gradient NaN
        scaled = mask.masked_fill(hidden, 0.0) * self.factor.to(computed)[..., None]
        return scaled.masked_fill(hidden, float("-inf")).to(dtype)

    def score_mod(self, dtype: torch.dtype, device) -> flex.ScoreMod:
        return flex.rows_scaled(self.base.score_mod(dtype, device), self.factor.to(precise(dtype)))
