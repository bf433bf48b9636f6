"""Scalable softmax on the queries (``--ssmax``)."""

import math
from dataclasses import dataclass, field
from typing import Dict

import torch
from torch import Tensor, nn

from kerple_fairseq.attention.methods.base import QUERIES, AttentionMethod, register_attention_method
from kerple_fairseq.errors import KernelConfigError

#: the scale's initial value: the one an implementation of the paper reports from it (the paper's
#: own code is not public); --ssmax-scale-init changes it
SSMAX_SCALE_INIT = 0.43


@dataclass
class SsmaxOptions:
    ssmax: bool = field(default=False, metadata={
        "help": "scalable softmax: each query times s_h log(n), n the keys it attends to, s_h learned per head and "
        "layer; composes with every method and backend"})
    ssmax_scale_init: float = field(default=SSMAX_SCALE_INIT, metadata={"help": "scalable softmax: the initial s_h"})


def visible_keys(first_position: int, num_queries: int, window: int, device) -> Tensor:
    """float64 ``[queries]``: the number of keys each query attends to, itself included: ``i + 1`` at
    absolute position ``i``, at most ``window`` (0: no window)."""
    counts = torch.arange(first_position + 1, first_position + num_queries + 1, dtype=torch.float64, device=device)
    return counts.clamp(max=window) if window else counts


@register_attention_method("ssmax")
class ScalableSoftmax(AttentionMethod):
    """Scalable softmax, SSMax (Nakanishi, "Scalable-Softmax Is Superior for Attention", 2025, §3):
    the logits of a query that attends to ``n`` keys are multiplied by ``s_h * log(n)``, so that its
    largest weight does not fade as ``n`` grows; ``s_h`` is learned, one per head of each layer.
    Here ``n = min(i + 1, window)`` for the query at position ``i``, and the factor multiplies the
    query: the logits ``q . k`` scale and a positional bias added to them does not; every backend
    serves it."""

    options = SsmaxOptions
    switch = "ssmax"
    acts_on = QUERIES

    def __init__(self, num_heads: int, head_dim: int = 0, ssmax: bool = True, ssmax_scale_init: float = SSMAX_SCALE_INIT):
        super().__init__()
        if not math.isfinite(ssmax_scale_init):
            raise KernelConfigError(f"--ssmax-scale-init must be a finite number, got {ssmax_scale_init}")
        self.scale = nn.Parameter(torch.full((num_heads,), float(ssmax_scale_init)))

    def scale_queries(self, q: Tensor, first_position: int, keys_seen: int) -> Tensor:
        """``q`` ``[B, H, T, D]`` at positions ``first_position ..``, each times ``s_h log(n)``."""
        log_n = visible_keys(first_position, q.size(2), keys_seen, q.device).log().to(q.dtype)
        return q * (self.scale.to(q.dtype)[:, None, None] * log_n[:, None])

    @classmethod
    def learned_values(cls, state: Dict[str, Tensor], prefix: str) -> Dict[str, Tensor]:
        """``s_h`` of the layer, as ``ssmax_s``."""
        return {"ssmax_s": state[prefix + "scale"]}

    def extra_repr(self) -> str:
        return f"heads={self.scale.numel()}"
