"""A block's bias with each query's row multiplied by a factor of its own (scalable softmax on the whole logit)."""

from typing import Optional

import torch
from torch import Tensor

from kerple_fairseq.attention import flex
from kerple_fairseq.precision import precise


class RowScaledBlockBias:
    """The bias of one block of queries (a :class:`~kerple_fairseq.attention.distance_bias.DistanceBlockBias`
    or a layer's :class:`~kerple_fairseq.attention.layer_bias.LayerBlockBias`) with row ``t`` of head ``h``
    multiplied by ``factor[h, t]`` (``[heads, block queries]``): laid out in float32 and cast once, ``-inf``
    kept where a query may not see a key (whatever the factor's sign, 0 included); for FlexAttention, the
    additive terms of the score modification scaled alike. A weight multiplies the scores as before. Having
    no per-distance values, it is never given to the kernel gradient backend, and FlexAttention serves it
    where it serves a layer's own bias (PyTorch 2.13's CPU compiler fails on its score modification too:
    a C++ compile error, measured)."""

    per_head_parameters = False
    has_layer_term = True

    def __init__(self, base, factor: Tensor):
        self.base = base
        self.factor = factor

    @property
    def block(self):
        return self.base.block

    @property
    def only_masks(self) -> bool:
        return self.base.only_masks

    @property
    def has_weight(self) -> bool:
        return self.base.has_weight

    @property
    def serves_flex(self) -> bool:
        return self.base.serves_flex

    def weight(self, dtype: torch.dtype, device) -> Optional[Tensor]:
        return self.base.weight(dtype, device)

    def mask(self, dtype: torch.dtype, device) -> Tensor:
        computed = precise(dtype)
        mask = self.base.mask(computed, device)
        hidden = mask.isneginf()
        # the hidden cells zeroed before the product: -inf times the factor would make its gradient NaN
        scaled = mask.masked_fill(hidden, 0.0) * self.factor.to(computed)[..., None]
        return scaled.masked_fill(hidden, float("-inf")).to(dtype)

    def score_mod(self, dtype: torch.dtype, device) -> flex.ScoreMod:
        return flex.rows_scaled(self.base.score_mod(dtype, device), self.factor.to(precise(dtype)))

    def block_mask(self, device, key_padding_mask: Optional[Tensor] = None):
        return self.base.block_mask(device, key_padding_mask)
