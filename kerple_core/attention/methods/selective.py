"""Selective attention: a token can hide earlier tokens from every token after it (``--selective-attention``).

Leviathan, Kalman and Matias, "Selective Attention Improves Transformer" (ICLR 2025), §2: from the
logits ``z`` of head 0 (scaled, with the positional bias, causally masked), the selection
``S_kj = relu(z0_kj)`` is 0 on the diagonal (a token does not hide itself) and for the first token
(which is never hidden), and is accumulated over earlier queries, ``F_ij = sum_{k<i} S_kj``;
``F`` is subtracted from the logits of every head. No parameters. x-transformers'
``selective_attn`` computes the same for one block of queries; here ``F`` also continues across
blocks of queries and incremental decoding, through a running sum ``[batch, keys]`` of ``S`` over the
queries already attended (cached beside the keys, trimmed and reordered with them), so a trimmed cache
equals scoring under the same attention window.

The selection and ``F`` are computed in float32 (float64 for float64 logits), whatever the model's
precision: ``F`` grows with the number of queries.
"""

from dataclasses import dataclass, field
from typing import Optional

import torch.nn.functional as F
from torch import Tensor

from kerple_core.attention.blocks import QueryBlock, diagonal
from kerple_core.attention.methods.base import (SCORES, AttentionMethod, CallTransforms,
                                                   register_attention_method)
from kerple_core.precision import precise


@dataclass
class SelectiveOptions:
    selective_attention: bool = field(default=False, metadata={
        "help": "selective attention: head 0's positive logits, summed over earlier queries, are subtracted from "
        "every head's logits (no parameters); composes with every kernel and rotary, not with DAPE, CoPE or "
        "ReRoPE; the explicit path, block by block"})


@register_attention_method("selective")
class SelectiveAttention(AttentionMethod):
    """Selective attention's logits (see the module); its running sums are cached as ``prev_selection``."""

    options = SelectiveOptions
    switch = "selective_attention"
    acts_on = SCORES
    cached_state = "prev_selection"

    def __init__(self, num_heads: int, head_dim: int, selective_attention: bool = True):
        super().__init__()

    def new_key_state(self, q: Tensor, k: Tensor, x: Tensor) -> Tensor:
        """Zeros ``[batch, new keys]``: no query has selected a new key yet."""
        dtype = precise(q.dtype)
        return q.new_zeros(q.size(0), q.size(2), dtype=dtype)

    def call_transforms(self, state: Optional[Tensor], first_key_position: int) -> "SelectionSums":
        return SelectionSums(state, first_key_position)


class SelectionSums(CallTransforms):
    """The running sum of the selection over the queries of one call, block after block.

    ``state`` ``[batch, keys]``: for every key of the call, ``sum_k S_kj`` over the queries before the
    call's first one (zeros for a call without cache); ``first_key_position``: the absolute position
    of the call's key 0. :meth:`transform` gives a block's score transform; blocks must be
    transformed in order of their queries, and :attr:`state` then holds the sum over every query of
    the call."""

    def __init__(self, sums: Tensor, first_key_position: int):
        super().__init__(None, sums)
        self.first_key_position = first_key_position

    def transform(self, block: QueryBlock):
        """The score transform ``(q, scores, mask) -> logits`` of ``block``: ``scores + mask - F``."""

        def selective_logits(q: Tensor, scores: Tensor, mask: Tensor) -> Tensor:
            dtype = precise(scores.dtype)
            logits = scores.to(dtype) + mask.to(dtype)
            selection = F.relu(logits[:, 0])  # [B, T, S]; hidden keys (-inf) select nothing
            never = diagonal(block, logits.device)
            if self.first_key_position + block.key_start == 0:
                never[:, 0] = True  # the first token
            selection = selection.masked_fill(never, 0.0)
            keys = slice(block.key_start, block.key_end)
            before = self.state[:, None, keys].to(dtype)
            # F_ij: the sums before the block, plus the block's earlier queries (an exclusive cumulative sum)
            forgotten = before + selection.cumsum(dim=1) - selection
            self.state = self.state + F.pad(selection.sum(dim=1), (block.key_start, self.state.size(1) - block.key_end))
            return logits - forgotten[:, None]

        return selective_logits
