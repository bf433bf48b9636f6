"""PaTH attention: keys carried to each query through data-dependent Householder transforms (``--path-attention``).

Yang et al., "PaTH Attention: Position Encoding via Accumulating Householder Transformations" (NeurIPS
2025), §3: the logit of query ``i`` and key ``j <= i`` is ``q_i^T H_i H_{i-1} ... H_{j+1} k_j / sqrt(d)``
with ``H_t = I - beta_t w_t w_t^T`` per head, ``w_t`` and ``beta_t`` computed from token ``t``'s layer
input ``x_t``. As the reference layer (flash-linear-attention's ``PaTHAttention``) computes them:
``w_t`` the head's slice of ``silu(conv(W_2 W_1 x))_t``, ``W_1`` of rank 32, ``conv`` a causal depthwise
convolution over 3 tokens, normalised to unit length per head; ``beta_t = 2 sigmoid(W_b x_t + b)`` in
``(0, 2)`` (eigenvalues of ``H`` down to -1). With ``--bias-kernel fox`` it is PaTH-FoX: the forget gate's
``log f`` sums are added to these logits, as the reference adds them.

Exact and recurrent, on the explicit path: each query ``t`` in turn applies ``H_t`` to every earlier key
(a rank-one update, ``k <- k - beta_t (k . w_t) w_t``) and reads its logits from the keys so carried,
its own key untransformed. The carried keys are cached (``prev_path_keys`` ``[batch, heads, 2 D + 1,
keys]``: each key in the frame of the last query seen, the token's ``W_2 W_1 x`` for the convolution of
the next ones, and ``beta``), so each decoding step is one rank-one update of the cache, as the
reference decodes. Computed in float32 (float64 in a float64 model); ``O(T S D)`` per block of ``T``
queries against ``S`` keys, a Python step per query.
"""

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kerple_core.attention.blocks import QueryBlock
from kerple_core.attention.methods.base import SCORES, AttentionMethod, CallTransforms, register_attention_method
from kerple_core.errors import KernelConfigError
from kerple_core.precision import precise

#: the rank of the reference's projection of the layer input to ``w``, and its convolution's width
PATH_RANK, PATH_CONV_WIDTH = 32, 3
#: the standard deviation of the reference's initialisation of linear layers (biases 0)
PATH_INIT_STD = 0.02


@dataclass
class PathOptions:
    path_attention: bool = field(default=False, metadata={
        "help": "PaTH attention: each key reaches query i through the product of the Householder-like "
        "transforms I - beta_t w_t w_t^T of the tokens between them, w and beta from each token's layer input; "
        "with --bias-kernel fox it is PaTH-FoX; the explicit path, one query at a time"})


@register_attention_method("path")
class PathAttention(AttentionMethod):
    """PaTH's logits (see the module): its projections of one layer and the carried keys of a call."""

    options = PathOptions
    switch = "path_attention"
    acts_on = SCORES
    cached_state = "prev_path_keys"

    def __init__(self, num_heads: int, head_dim: int, embed_dim: int, path_attention: bool = True):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.w_proj = nn.Sequential(nn.Linear(embed_dim, PATH_RANK, bias=False),
                                    nn.Linear(PATH_RANK, num_heads * head_dim, bias=False))
        self.w_conv = nn.Conv1d(num_heads * head_dim, num_heads * head_dim, PATH_CONV_WIDTH,
                                groups=num_heads * head_dim, bias=False)
        self.beta_proj = nn.Linear(embed_dim, num_heads)
        for linear in (*self.w_proj, self.beta_proj):
            nn.init.normal_(linear.weight, std=PATH_INIT_STD)
        nn.init.zeros_(self.beta_proj.bias)

    @classmethod
    def build(cls, num_heads: int, head_dim: int, cfg) -> "PathAttention":
        """One layer's instance; a trimmed cache must keep the tokens the convolution reads."""
        cache = getattr(cfg, "max_cache_window", 0) or 0
        if 0 < cache < PATH_CONV_WIDTH - 1:
            raise KernelConfigError(f"--path-attention reads the {PATH_CONV_WIDTH - 1} tokens before each one: "
                                    f"--max-cache-window must be 0 or >= {PATH_CONV_WIDTH - 1}, got {cache}")
        return cls(num_heads, head_dim, num_heads * head_dim)

    def new_key_state(self, q: Tensor, k: Tensor, x: Tensor) -> Tensor:
        """``[batch, heads, 2 D + 1, new keys]``: each new key (``k`` ``[B, H, T, D]``, in its own frame),
        its token's ``W_2 W_1 x`` and ``beta``, from the layer input ``x`` ``[T, B, E]``."""
        dtype = precise(q.dtype)
        batch, heads, length, dim = k.shape
        projected = self.w_proj(x).to(dtype).view(length, batch, heads, dim).permute(1, 2, 3, 0)
        beta = 2 * torch.sigmoid(self.beta_proj(x).to(dtype)).permute(1, 2, 0)[:, :, None]  # [B, H, 1, T]
        return torch.cat([k.to(dtype).transpose(-1, -2), projected, beta], dim=2)

    def directions(self, projected: Tensor, new: int) -> Tensor:
        """``w`` ``[B, H, D, new]`` of the last ``new`` tokens of ``projected`` ``[B, H, D, keys]`` (the
        convolution reads the tokens before them, zeros before the first)."""
        batch, heads, dim, keys = projected.shape
        context = projected[..., max(0, keys - new - PATH_CONV_WIDTH + 1):]
        context = F.pad(context, (new + PATH_CONV_WIDTH - 1 - context.size(-1), 0))
        weight = self.w_conv.weight.to(projected.dtype)
        w = F.silu(F.conv1d(context.reshape(batch, heads * dim, -1), weight, groups=heads * dim))
        return F.normalize(w.view(batch, heads, dim, new), dim=2)

    def call_transforms(self, state: Optional[Tensor], first_key_position: int) -> "CarriedKeys":
        return CarriedKeys(self, state)


class CarriedKeys(CallTransforms):
    """The keys of one call carried to each of its queries in turn, block after block (blocks must be
    transformed in the order of their queries); :attr:`state` then holds every key in the frame of the
    call's last query, to cache."""

    def __init__(self, method: PathAttention, state: Tensor):
        super().__init__(method, state)
        dim = method.head_dim
        self.keys, self.projected, self.beta = state[:, :, :dim], state[:, :, dim:2 * dim], state[:, :, 2 * dim]
        self.num_keys = state.size(-1)
        self.new = None  # the call's new tokens: their number, w and beta, known at the first block

    def transform(self, block: QueryBlock):
        """The score transform ``(q, scores, mask) -> logits`` of ``block``: PaTH's logits plus ``mask``."""

        def path_logits(q: Tensor, scores: Tensor, mask: Tensor) -> Tensor:
            if self.new is None:
                num_new = self.num_keys - (block.key_end - block.query_end)  # the call's queries
                self.new = num_new, self.method.directions(self.projected, num_new), self.beta[..., -num_new:]
            num_new, directions, betas = self.new
            dtype = self.keys.dtype
            first_new_key = self.num_keys - num_new
            rows = []
            for t in range(block.query_start, block.query_end):
                key = first_new_key + t  # the query's own key
                w, beta = directions[..., t], betas[..., t]  # [B, H, D], [B, H]
                earlier = self.keys[..., :key]
                carried = earlier - (beta[..., None] * torch.einsum("bhds,bhd->bhs", earlier, w))[:, :, None] \
                    * w[..., None]
                self.keys = torch.cat([carried, self.keys[..., key:]], dim=-1)
                seen = self.keys[..., block.key_start:key + 1]
                row = torch.einsum("bhd,bhds->bhs", q[:, :, t - block.query_start].to(dtype), seen)
                rows.append(F.pad(row, (0, block.key_end - key - 1)))
            self.state = torch.cat([self.keys, self.projected, self.beta[:, :, None]], dim=2)
            return torch.stack(rows, dim=2) + mask.to(dtype)

        return path_logits
