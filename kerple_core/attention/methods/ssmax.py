"""Scalable softmax (``--ssmax``): each query's logits times ``s_h log n``, the bias with them by default."""

import math
from dataclasses import dataclass, field
from typing import Dict

import torch
from fairseq.dataclass import ChoiceEnum
from torch import Tensor, nn

from kerple_core.attention.methods.base import QUERIES, AttentionMethod, register_attention_method
from kerple_core.attention.scaled_bias import RowScaledBlockBias
from kerple_core.errors import KernelConfigError
from kerple_core.kernels.registry import SAVED_BEFORE
from kerple_core.precision import precise
from kerple_core.visibility import Visibility

#: the scale's initial value: the one an implementation of the paper reports from it (the paper's
#: own code is not public); --ssmax-scale-init changes it
SSMAX_SCALE_INIT = 0.43
#: what the factor multiplies: the whole logit, positional bias included (the paper's and its package's),
#: or ``q . k`` alone (the bias added unscaled)
SCOPES = ["logits", "queries"]


@dataclass
class SsmaxOptions:
    ssmax: bool = field(default=False, metadata={
        "help": "scalable softmax: each query times s_h log(n), n the keys it attends to, s_h learned per head and "
        "layer; composes with every method and backend"})
    ssmax_scale_init: float = field(default=SSMAX_SCALE_INIT, metadata={"help": "scalable softmax: the initial s_h"})
    ssmax_scope: ChoiceEnum(SCOPES) = field(default="logits", metadata={
        "help": "scalable softmax: what s_h log(n) multiplies: logits (the paper's and the scalable-softmax "
        "package's: q.k/sqrt(d) plus the positional bias) or queries (q.k alone, the bias added unscaled)",
        SAVED_BEFORE: "queries"})


@register_attention_method("ssmax")
class ScalableSoftmax(AttentionMethod):
    """Scalable softmax, SSMax (Nakanishi, "Scalable-Softmax Is Superior for Attention", 2025, §3):
    the logits of a query that attends to ``n`` keys are multiplied by ``s_h * log(n)``, so that its
    largest weight does not fade as ``n`` grows; ``s_h`` is learned, one per head of each layer.
    Here ``n`` is what the layer's visibility lets the query at position ``i`` see (``min(i + 1, window)``). By default the factor multiplies
    the whole logit, ``s_h log(n) (q.k/sqrt(d) + B)``, as the paper, its ``scalable-softmax`` package
    and BAM's reference code (``ArthurSBianchessi/BAM``) do: the query is scaled, and each block's
    bias row by row (:class:`~kerple_core.attention.scaled_bias.RowScaledBlockBias`); with
    ``--ssmax-scope queries`` only ``q.k`` is scaled and the bias added unscaled. Every backend serves
    both (a scaled bias as a layer's own bias is served)."""

    options = SsmaxOptions
    switch = "ssmax"
    acts_on = QUERIES
    counts_keys_seen = True

    def __init__(self, num_heads: int, head_dim: int = 0, ssmax: bool = True,
                 ssmax_scale_init: float = SSMAX_SCALE_INIT, ssmax_scope: str = "logits"):
        super().__init__()
        if not math.isfinite(ssmax_scale_init):
            raise KernelConfigError(f"--ssmax-scale-init must be a finite number, got {ssmax_scale_init}")
        if str(ssmax_scope) not in SCOPES:
            raise KernelConfigError(f"--ssmax-scope must be one of {', '.join(SCOPES)}, got {ssmax_scope!r}")
        self.scale = nn.Parameter(torch.full((num_heads,), float(ssmax_scale_init)))
        self.scope = str(ssmax_scope)

    def factor(self, first_position: int, num_queries: int, visibility: Visibility, dtype: torch.dtype,
               device) -> Tensor:
        """``[heads, queries]``: ``s_h log(n)`` of the queries at positions ``first_position ..``."""
        log_n = visibility.keys_seen(first_position, num_queries, device).log().to(dtype)
        return self.scale.to(dtype)[:, None] * log_n

    def scale_queries(self, q: Tensor, first_position: int, visibility: Visibility) -> Tensor:
        """``q`` ``[B, H, T, D]`` at positions ``first_position ..``, each times ``s_h log(n)``."""
        return q * self.factor(first_position, q.size(2), visibility, q.dtype, q.device)[..., None]

    def scale_bias(self, bias, first_position: int, visibility: Visibility):
        """With ``--ssmax-scope logits``, the block's bias times its queries' factors (in float32, or
        float64 for a float64 model)."""
        if self.scope != "logits" or bias.only_masks:
            return bias
        block = bias.block
        factor = self.factor(first_position + block.query_start, block.num_queries, visibility,
                             precise(self.scale.dtype), self.scale.device)
        return RowScaledBlockBias(bias, factor)

    @classmethod
    def learned_values(cls, state: Dict[str, Tensor], prefix: str) -> Dict[str, Tensor]:
        """``s_h`` of the layer, as ``ssmax_s``."""
        return {"ssmax_s": state[prefix + "scale"]}

    def extra_repr(self) -> str:
        return f"heads={self.scale.numel()}, scope={self.scope}"
