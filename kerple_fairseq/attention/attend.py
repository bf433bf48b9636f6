"""How one block of queries is attended: the attention math, apart from the module.

:func:`attend` takes a block's queries, keys and values and what biases its scores (a
:class:`~kerple_fairseq.attention.distance_bias.DistanceBlockBias`, which lays out the
bias, and the weight of a weight kernel, only when a backend asks) and picks a backend:

- **explicit**: ``softmax(S * W + B) V`` with the scores ``S = q k^T`` materialised; the
  reference path, and the only one that returns probabilities, takes key padding or a
  weight kernel's ``W``;
- **sdpa**: PyTorch's ``scaled_dot_product_attention`` with the bias as a 4-D additive mask
  (fused kernels on CPU and CUDA);
- **kernel gradient**: on CPU, for learnable per-head kernels in training, PyTorch's fused
  kernel with the kernel parameters' gradient from extra fused forwards
  (:mod:`kerple_fairseq.attention.kernel_gradient`).

Dense attention, incremental decoding and long sequences differ only in their blocks
(:mod:`kerple_fairseq.attention.blocks`); every backend gives the same result.

How the next methods plug in:

- A **position-dependent kernel** such as FIRE, ``b(i, j) = f(psi(i - j) / psi(max(L, i)))``,
  is another bias source beside :class:`~kerple_fairseq.attention.distance_bias.DistanceBias`:
  its block view lays out ``[heads, queries, keys]`` from the block's absolute query and key
  positions (the block's offset plus the position of its first key) instead of from one
  vector per distance, so incremental decoding computes only the new rows. ``mask()`` is all
  the explicit and sdpa backends need; it offers no per-distance values, so the kernel
  gradient backend steps aside (:func:`kernel_gradient.applies` asks the view).
- A **content-dependent bias per batch element and layer**, such as the Forgetting
  Transformer's ``c_i - c_j`` with ``c`` the running sum of log forget gates, is a source
  built by each layer from its input: its ``mask()`` is ``[batch, heads, queries, keys]``
  (``c`` of the block's queries minus ``c`` of its keys, so no more than one block of it
  exists), which both backends broadcast like the shared ``[heads, ...]`` bias; the running
  ``c`` of past positions is kept in the layer's key/value cache beside the keys, so beam
  reordering carries it.
- A **score-transforming method** such as DAPE, ``Z = S + B + g([S; B])`` with ``g`` a small
  learned function across all heads at each ``(i, j)``, needs the scores: it is an option of
  the explicit backend, applied to the block's ``S`` and ``B`` before the softmax (future
  cells zeroed first, as its convolutional variant requires), block by block, so no
  ``L x L x batch`` tensor exists beyond one block.
"""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from kerple_fairseq.attention import kernel_gradient
from kerple_fairseq.attention.distance_bias import DistanceBlockBias


def choose_backend(q: Tensor, k: Tensor, bias: DistanceBlockBias, *, fused: bool, dropout: float,
                   key_padding_mask: Optional[Tensor], need_probabilities: bool) -> str:
    """The backend for a block: explicit wherever scores or probabilities are needed (weights
    requested, key padding, a weight kernel) or fusing is off; otherwise sdpa, or the kernel
    gradient backend where it applies."""
    if not fused or need_probabilities or key_padding_mask is not None or bias.has_weight:
        return "explicit"
    if kernel_gradient.applies(q, k, bias, dropout):
        return "kernel gradient"
    return "sdpa"


def attend(q: Tensor, k: Tensor, v: Tensor, bias: DistanceBlockBias, *, fused: bool = True, dropout: float = 0.0,
           key_padding_mask: Optional[Tensor] = None,
           need_probabilities: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
    """Attention of one block: ``q`` ``[B, H, T, D]`` (already scaled by ``1/sqrt(D)``), ``k`` and
    ``v`` ``[B, H, S, D]`` (the block's keys), ``key_padding_mask`` ``[B, S]`` (True: padding).
    Returns the attended values ``[B, H, T, D]`` and, with ``need_probabilities``, the float32
    probabilities ``[B, H, T, S]``."""
    backend = choose_backend(q, k, bias, fused=fused, dropout=dropout, key_padding_mask=key_padding_mask,
                             need_probabilities=need_probabilities)
    if backend == "kernel gradient":
        return kernel_gradient.attend_with_kernel_gradient(q, k, v, bias), None
    if backend == "sdpa":
        mask = bias.mask(q.dtype, q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None], dropout_p=dropout, scale=1.0), None
    scores = biased_scores(q, k, bias, key_padding_mask)
    # in float32 for half-precision scores (as fairseq does), in float64 for float64 ones
    probabilities = torch.softmax(scores, dim=-1, dtype=torch.float64 if scores.dtype == torch.float64 else torch.float32)
    attended = torch.matmul(F.dropout(probabilities.type_as(q), p=dropout, training=dropout > 0), v)
    return attended, probabilities if need_probabilities else None


def biased_scores(q: Tensor, k: Tensor, bias: DistanceBlockBias, key_padding_mask: Optional[Tensor] = None) -> Tensor:
    """``[B, H, T, S]`` logits ``(q k^T) * W + B``, ``-inf`` at padded keys."""
    scores = torch.matmul(q, k.transpose(-1, -2))
    weight = bias.weight(q.dtype, q.device)
    if weight is not None:
        scores = scores * weight
    scores += bias.mask(q.dtype, q.device)  # [H, T, S], broadcast over the batch, in place
    if key_padding_mask is not None:
        scores.masked_fill_(key_padding_mask[:, None, None, :].to(torch.bool), float("-inf"))
    return scores
