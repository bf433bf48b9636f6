"""A block's distance bias plus the bias one layer builds for itself."""

from typing import Callable, Optional

import torch
from torch import Tensor

from kerple_fairseq.attention.distance_bias import DistanceBlockBias


class LayerBlockBias:
    """The bias of one block of queries: the distance bias (causal mask, any attention window, the
    distance kernel) plus a layer's own bias (:class:`~kerple_fairseq.layer_biases.LayerBias`),
    summed in float32 and cast once. Offers what the backends ask of a
    :class:`DistanceBlockBias`; having no per-distance values, it is never given to the kernel
    gradient backend."""

    per_head_parameters = False

    def __init__(self, base: DistanceBlockBias, layer_bias: Callable[[], Tensor]):
        self.base = base
        self.layer_bias = layer_bias

    @property
    def block(self):
        return self.base.block

    @property
    def has_weight(self) -> bool:
        return self.base.has_weight

    def weight(self, dtype: torch.dtype, device) -> Optional[Tensor]:
        return self.base.weight(dtype, device)

    def mask(self, dtype: torch.dtype, device) -> Tensor:
        """``[heads, queries, keys]`` or ``[batch, heads, queries, keys]``: both biases, ``-inf``
        for keys a query may not see."""
        precise = torch.float64 if dtype == torch.float64 else torch.float32
        return (self.base.mask(precise, device) + self.layer_bias()).to(dtype)
