"""CoPE: positions counted by the query's gates over the keys, and their learned embeddings in the
logits (``--cope``)."""

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from kerple_core.attention.methods.base import SCORES, AttentionMethod, register_attention_method
from kerple_core.errors import KernelConfigError
from kerple_core.precision import precise


@dataclass
class CopeOptions:
    cope: bool = field(default=False, metadata={
        "help": "CoPE: add q . e(p) to the logits, p the sum of the query's gates sigmoid(q . k) from each key to "
        "itself, e a learned table per layer read between integer positions; composes with every kernel and "
        "rotary; attention then runs on the explicit path, block by block"})
    cope_max_positions: int = field(default=0, metadata={
        "help": "CoPE: positions in each layer's table (counts are clipped below it); 0: --tokens-per-sample + 1"})


@register_attention_method("cope")
class ContextualPositions(AttentionMethod):
    """Contextual position encoding (Golovneva et al., "Contextual Position Encoding: Learning to
    Count What's Important", 2024, §4), one layer's:

        g_it = sigmoid(S_it)                     (S = q.k / sqrt(D), the scaled score; 0 where i may not see t)
        p_ij = min(sum_{t=j..i} g_it, P - 1)     (a fractional count of the keys from j to i)
        Z_ij = S_ij + B_ij + q_i . e(p_ij) / sqrt(D)

    ``e`` is a learned table ``[D, P]`` shared by the layer's heads, starting at zero, read
    between integer positions by linear interpolation: ``e(p) = (p - floor p) e[ceil p] +
    (1 - p + floor p) e[floor p]``. ``B`` is the positional bias (``-inf`` where the query may
    not see the key; 0 for CoPE alone). As in the reference (``facebookresearch/RAM``,
    ``projects/cope``): gates from the scores alone, the table per layer and zero at the start,
    ``P`` the training length + 1; ``e`` is read by the scaled query, as its sum with the score is
    scaled there.

    A query's positions need only its own row of scores, so the attention passes one block of
    queries at a time against every key they may see, and decoding one token equals scoring
    the sequence. Gates, their sums and the interpolation are float32 (a sum over thousands of
    keys in fp16 would lose whole positions; float64 for float64 scores), cast once.
    """

    options = CopeOptions
    switch = "cope"
    acts_on = SCORES

    @classmethod
    def build(cls, num_heads: int, head_dim: int, cfg) -> "ContextualPositions":
        """``P`` is ``--cope-max-positions``, or the training length + 1."""
        positions = getattr(cfg, "cope_max_positions", 0) or (getattr(cfg, "tokens_per_sample", 0) or 0) + 1
        return cls(head_dim, positions)

    def __init__(self, head_dim: int, max_positions: int):
        super().__init__()
        if max_positions < 2:
            raise KernelConfigError(f"--cope-max-positions must be >= 2, got {max_positions}")
        self.embeddings = nn.Parameter(torch.zeros(head_dim, max_positions))

    @property
    def max_positions(self) -> int:
        return self.embeddings.size(1)

    def positions(self, scores: Tensor, bias: Tensor) -> Tensor:
        """``p`` ``[batch, H, T, S]`` of the scaled ``scores`` under ``bias``: float32, float64 for float64 scores."""
        dtype = precise(scores.dtype)
        gates = torch.sigmoid(scores.to(dtype)).masked_fill(~torch.isfinite(bias), 0.0)
        counts = gates.flip(-1).cumsum(-1).flip(-1)
        return counts.clamp(max=self.max_positions - 1)

    def forward(self, q: Tensor, scores: Tensor, bias: Tensor) -> Tensor:
        """The logits of a block: ``q`` ``[batch, H, T, D]`` (scaled by ``1/sqrt(D)``), ``scores``
        ``[batch, H, T, S]``, ``bias`` ``[H, T, S]`` or ``[batch, H, T, S]``."""
        positions = self.positions(scores, bias)
        below = positions.floor()
        weight = positions - below
        per_position = torch.matmul(q, self.embeddings.to(q.dtype))  # [batch, H, T, P]
        at_below = per_position.gather(-1, below.long()).to(weight.dtype)
        at_above = per_position.gather(-1, positions.ceil().long()).to(weight.dtype)
        term = at_above * weight + at_below * (1.0 - weight)
        return scores + bias + term.to(scores.dtype)

