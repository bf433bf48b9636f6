"""Stick-breaking attention: attention weights without a softmax (``--stick-breaking``).

Tan et al., "Scaling Stick-Breaking Attention" (ICLR 2025), §2: with ``b_ij = sigmoid(z_ij)`` from the
logits ``z``, query ``i`` gives key ``j < i`` the weight

    ``A_ij = b_ij * prod_{j<k<i} (1 - b_ik)``,

breaking a stick of length 1 from its most recent key backwards, and keeps the remainder
``r_i = prod_{k<i} (1 - b_ik) = 1 - sum_j A_ij``. As the reference (shawntan/stickbreaking-attention,
``sb_attn``, and flash-linear-attention's ``parallel_stickbreaking_attn``) does by default, the
query's own key takes no part in the product (``attend_current=False``), and the weights are computed
in log space, ``log A_ij = logsigmoid(z_ij) + sum_{j<k<i} logsigmoid(-z_ik)``, in float32 (float64
for float64 logits). The remainder goes to the query's own value, ``o_i = sum_j A_ij v_j + r_i v_i``,
as the reference's tests combine the kernel's two outputs; the weights returned here therefore put
``r_i`` on the diagonal and sum to one in every row.

Keys a query may not see (future, outside an attention window, padding) have logit ``-inf``: weight
0 and a factor ``1 - b = 1`` in every product, so a window or a trimmed cache breaks the stick over
the keys inside it only.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from kerple_core.attention.blocks import QueryBlock, diagonal
from kerple_core.attention.methods.base import WEIGHTS, AttentionMethod, register_attention_method
from kerple_core.precision import precise


@dataclass
class StickBreakingOptions:
    stick_breaking: bool = field(default=False, metadata={
        "help": "stick-breaking attention instead of the softmax: key j < i gets sigmoid(z_ij) of what the keys "
        "between them left, the remainder goes to the query's own value; composes with every kernel (usually "
        "none) and logit method; attention then runs on the explicit path, block by block"})


@register_attention_method("stick_breaking")
class StickBreaking(AttentionMethod):
    """Stick-breaking weights in place of the softmax (:func:`stick_breaking_weights`); no parameters."""

    options = StickBreakingOptions
    switch = "stick_breaking"
    acts_on = WEIGHTS

    def __init__(self, num_heads: int, head_dim: int, stick_breaking: bool = True):
        super().__init__()

    def weights(self, logits: Tensor, block: QueryBlock) -> Tensor:
        return stick_breaking_weights(logits, block)


def stick_breaking_weights(logits: Tensor, block: QueryBlock) -> Tensor:
    """The weights ``[..., queries, keys]`` of a block from its logits ``z`` (``-inf`` at hidden
    keys): ``A_ij`` off the diagonal and the remainder ``r_i`` on it, in float32 (float64 for
    float64 logits)."""
    dtype = precise(logits.dtype)
    own = diagonal(block, logits.device)
    z = logits.to(dtype).masked_fill(own, float("-inf"))
    log_kept = F.logsigmoid(-z)  # log(1 - b_ik); 0 at hidden keys and the diagonal
    # sum over the keys after j (k > j, up to the query): a reversed cumulative sum, less key j itself
    after = log_kept.flip(-1).cumsum(-1).flip(-1) - log_kept
    weights = torch.exp(F.logsigmoid(z) + after)
    remainder = torch.exp(log_kept.sum(-1, keepdim=True))
    return weights + remainder * own
