"""How one block of queries is attended: the attention math, apart from the module.

:func:`attend` takes a block's queries, keys and values and what biases its scores (a
:class:`~kerple_core.attention.block_bias.BlockBias`, which lays out the bias, and the
weight of a weight kernel, only when a backend asks) and picks a backend
(:func:`choose_backend`, ``--attention-backend``):

- **explicit**: ``softmax(S * W + B) V`` with the scores ``S = q k^T`` materialised; the
  reference path, and the only one that returns probabilities or takes a score transform;
- **fused**: a Triton kernel in FlashAttention-2's tiling (:mod:`kerple_core.attention.fused`) that reads
  a distance kernel's per-distance values (and the Forgetting Transformer's gate state) inside the kernel,
  forward and backward, attention dropout included; by default on CUDA wherever it serves;
- **flex**: FlexAttention (:mod:`kerple_core.attention.flex`) with the bias read inside
  the kernel from its per-distance values (and a layer's own term), added in float32, never
  laid out; on CUDA in training and evaluation (not with attention dropout, which it lacks),
  on CPU without gradients;
- **sdpa**: PyTorch's ``scaled_dot_product_attention`` with the bias as a 4-D additive mask
  (fused kernels on CPU and CUDA);
- **kernel gradient**: on CPU, for learnable per-head kernels in training, PyTorch's fused
  kernel with the kernel parameters' gradient from extra fused forwards
  (:mod:`kerple_core.attention.kernel_gradient`).

Dense attention, incremental decoding and long sequences differ only in their blocks
(:mod:`kerple_core.attention.blocks`); every backend gives the same result.

Other methods plug in as follows:

- a **bias built by each layer** (:mod:`kerple_core.layer_biases`: FIRE from the absolute
  positions of the block's queries and keys, the Forgetting Transformer from the layer's input)
  is added to the block's distance bias by :class:`~kerple_core.attention.layer_bias.LayerBlockBias`,
  ``[heads, ...]`` or ``[batch, heads, ...]`` (or as a score term for FlexAttention);
- an **attention method** (:mod:`kerple_core.attention.methods`) acts on the queries before any
  backend sees them (scalable softmax, Llama 4's temperature), or needs the scores: a score transform
  (DAPE, CoPE, selective attention, PaTH, and ReRoPE's merged logits from
  :mod:`kerple_core.attention.rotary`) or weights in place of the softmax (stick-breaking), which
  run on the explicit backend, one block at a time.

An :class:`AttentionRecord` given to :func:`attend` counts the backends chosen and keeps the logits.
"""

import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from torch.nn.attention import SDPBackend, sdpa_kernel

from kerple_core.attention import flex, fused, kernel_gradient
from kerple_core.attention.blocks import QueryBlock
from kerple_core.errors import KernelConfigError
from kerple_core.attention.block_bias import BlockBias
from kerple_core.precision import precise

#: ``transform(q, scores, bias)``: the logits from the block's queries, scores and bias (DAPE, CoPE)
ScoreTransform = Callable[[Tensor, Tensor, Tensor], Tensor]
#: ``weights(logits, block)``: the block's attention weights, in place of the softmax (stick-breaking)
AttentionWeights = Callable[[Tensor, QueryBlock], Tensor]

#: ``--attention-backend`` choices
BACKENDS = ("auto", "fused", "flex", "sdpa", "explicit")
#: fewest keys from which ``auto`` uses compiled FlexAttention on CPU: whole-model evaluation
#: (scripts/benchmark.py, 2 cores) measured it even with sdpa at 2048 keys and 0.2-0.25x of ``none``'s
#: time ahead at 8192
FLEX_MIN_KEYS_CPU = 4096
#: smallest head dimension FlexAttention's CUDA kernels take (PyTorch 2.11: "NYI: embedding dimension of
#: the query, key, and value must be at least 16", measured on an H200)
FLEX_MIN_HEAD_DIM_CUDA = 16


def masked_sdpa_backends(dtype: torch.dtype) -> List[SDPBackend]:
    """SDPA's backends for a masked call on CUDA (flash takes no mask). Never cuDNN, whose query gradient
    is NaN with a mask when L % 128 == 64 and a row's log-sum-exp is below about -88.7 (PyTorch issue
    196678, torch 2.11-2.13). In float32 the math backend alone: the memory-efficient kernel's float32
    gradients missed the float64 reference by 7-10x the tolerance the other paths meet (a tiny
    ``gauss_bias3`` model, torch 2.11 on an H100 and an H200, TF32 off; the same with the mask detached,
    laid out per sequence, stored aligned, and at 320 and 336 tokens), while the math backend, the
    explicit path and FlexAttention met it."""
    if dtype == torch.float32:
        return [SDPBackend.MATH]
    return [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class AttentionRecord:
    """What attention did while the record was given to it: the backend of each block and, with
    ``keep_logits``, the logits of each block attended (every block then on the explicit backend);
    :func:`~kerple_core.attention.self_attention.recorded` lays them out per call, with its
    probabilities."""

    keep_logits: bool = False
    backends: Counter = field(default_factory=Counter)
    logits: List[Tensor] = field(default_factory=list)
    probabilities: List[Tensor] = field(default_factory=list)


def choose_backend(q: Tensor, k: Tensor, bias: BlockBias, *, preference: str = "auto", dropout: float,
                   key_padding_mask: Optional[Tensor], need_probabilities: bool, needs_scores: bool = False) -> str:
    """The backend for a block. Explicit wherever scores or probabilities are needed (weights
    requested, an attention method that ``needs_scores``) or asked for. Then the fused kernel where it
    serves (:func:`~kerple_core.attention.fused.serves`), if asked for (a device it cannot run on is refused:
    :class:`KernelConfigError`), and by default on CUDA (training,
    with any dropout, and evaluation). Then FlexAttention where it serves
    (:func:`flex_serves`), if asked for, and by default on CUDA and for at least
    :data:`FLEX_MIN_KEYS_CPU` keys on CPU. Otherwise explicit for key padding or a weight kernel,
    the kernel gradient backend where it applies, else sdpa."""
    if preference not in BACKENDS:
        raise ValueError(f"unknown attention backend {preference!r}; choose one of: {', '.join(BACKENDS)}")
    if preference == "fused" and not fused.runs_on(q.device):
        raise KernelConfigError(fused.not_running_on(q.device))
    if preference == "explicit" or need_probabilities or needs_scores:
        return "explicit"
    if (preference == "fused" or (preference == "auto" and q.device.type == "cuda")) and fused.serves(q, bias):
        return "fused"
    if preference != "sdpa" and flex_serves(q, bias, dropout, key_padding_mask) and (
            preference == "flex" or q.device.type == "cuda" or k.size(2) >= FLEX_MIN_KEYS_CPU):
        return "flex"
    if key_padding_mask is not None or bias.has_weight:
        return "explicit"
    if kernel_gradient.applies(q, k, bias, dropout):
        return "kernel gradient"
    return "sdpa"


def flex_serves(q: Tensor, bias: BlockBias, dropout: float, key_padding_mask: Optional[Tensor]) -> bool:
    """FlexAttention can attend the block (every bias has a score modification): a dtype it takes (not float64), no attention dropout; on CUDA, heads of at least
    :data:`FLEX_MIN_HEAD_DIM_CUDA` dimensions, and a term beside the kernel's that reads the model's
    tensors (a layer's parameters or state, SSMax's row factors) only without gradients (PyTorch 2.11
    compiles no backward for FoX's term, which indexes its cumulative gates twice, nor for FIRE's:
    measured on an H200, the first NotImplementedError, the second a FakeTensor assertion; through
    chunked attention's mask of positions it does: measured on an H100); on CPU, no
    gradient (it has no CPU backward) and, compiled, neither key padding nor a layer's own bias
    (PyTorch 2.13's CPU compiler fails on terms that read the batch index, as padding and FoX do, and on
    FIRE's)."""
    if not (flex.available() and dropout == 0.0 and q.dtype in flex.DTYPES):
        return False
    if q.device.type == "cuda":
        return q.size(-1) >= FLEX_MIN_HEAD_DIM_CUDA and not (torch.is_grad_enabled() and bias.term_reads_model_tensors)
    return (q.device.type == "cpu" and not torch.is_grad_enabled()
            and (not flex.COMPILED or (key_padding_mask is None and not bias.has_layer_term)))


def attend(q: Tensor, k: Tensor, v: Tensor, bias: BlockBias, *, preference: str = "auto",
           dropout: float = 0.0, key_padding_mask: Optional[Tensor] = None, need_probabilities: bool = False,
           score_transform: Optional[ScoreTransform] = None, weights: Optional[AttentionWeights] = None,
           record: Optional[AttentionRecord] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """Attention of one block: ``q`` ``[B, H, T, D]`` (already scaled by ``1/sqrt(D)``), ``k`` and
    ``v`` ``[B, H, S, D]`` (the block's keys), ``key_padding_mask`` ``[B, S]`` (True: padding);
    ``weights``: the weights from the logits instead of the softmax.
    Returns the attended values ``[B, H, T, D]`` and, with ``need_probabilities``, the float32
    probabilities ``[B, H, T, S]``."""
    backend = choose_backend(q, k, bias, preference=preference, dropout=dropout, key_padding_mask=key_padding_mask,
                             need_probabilities=need_probabilities,
                             needs_scores=score_transform is not None or weights is not None)
    if record is not None:
        record.backends[backend] += 1
    if backend == "fused":
        try:
            return fused.attend(q, k, v, bias, dropout=dropout, key_padding_mask=key_padding_mask), None
        except fused.kernel_errors() as error:
            if preference == "fused":
                raise
            fused.set_aside(error)  # chosen by auto: the other backends serve from now on
            if record is not None:
                record.backends[backend] -= 1
            return attend(q, k, v, bias, preference=preference, dropout=dropout, key_padding_mask=key_padding_mask,
                          need_probabilities=need_probabilities, score_transform=score_transform, weights=weights,
                          record=record)
    if backend == "flex":
        padding = None if key_padding_mask is None else key_padding_mask.to(torch.bool)
        return flex.attend(q, k, v, bias.score_mod(q.dtype, q.device), bias.block_mask(q.device, padding)), None
    if backend == "kernel gradient":
        return kernel_gradient.attend_with_kernel_gradient(q, k, v, bias), None
    if backend == "sdpa":
        mask = bias.mask(q.dtype, q.device)
        mask = mask if mask.dim() == 4 else mask[None]
        with sdpa_kernel(masked_sdpa_backends(q.dtype)) if q.device.type == "cuda" else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=1.0), None
    scores = biased_scores(q, k, bias, key_padding_mask, score_transform)
    if record is not None and record.keep_logits:
        record.logits.append(scores)
    sees_nothing = None
    if key_padding_mask is not None:
        # a padded query whose window (or chunk) holds only padding sees no key: it attends to nothing
        # (as in FlexAttention), its row computed from zeros so that neither its values nor its gradient
        # is NaN (a NaN there would reach every parameter through the backward pass)
        sees_nothing = torch.isneginf(scores).all(dim=-1, keepdim=True)
        scores = scores.masked_fill(sees_nothing, 0.0)
    if weights is not None:
        probabilities = weights(scores, bias.block)
    else:
        # in float32 for half-precision scores (as fairseq does), in float64 for float64 ones
        probabilities = torch.softmax(scores, dim=-1,
                                      dtype=precise(scores.dtype))
    if sees_nothing is not None:
        probabilities = probabilities.masked_fill(sees_nothing, 0.0)
    attended = torch.matmul(F.dropout(probabilities.type_as(q), p=dropout, training=dropout > 0), v)
    return attended, probabilities if need_probabilities else None


def biased_scores(q: Tensor, k: Tensor, bias: BlockBias, key_padding_mask: Optional[Tensor] = None,
                  score_transform: Optional[ScoreTransform] = None) -> Tensor:
    """``[B, H, T, S]`` logits ``(q k^T) * W + B`` (or ``score_transform`` of ``q``, ``(q k^T) * W``
    and ``B``), ``-inf`` at padded keys. In half precision the bias is added in float32 (the softmax
    reads float32 anyway), except under a score transform, whose layers run in the model's dtype."""
    scores = torch.matmul(q, k.transpose(-1, -2))
    dtype = q.dtype
    if score_transform is None and dtype in (torch.float16, torch.bfloat16):
        scores, dtype = scores.float(), torch.float32
    weight = bias.weight(dtype, q.device)
    if weight is not None:
        scores = scores * weight
    mask = bias.mask(dtype, q.device)  # [H, T, S] (broadcast over the batch) or [B, H, T, S]
    padding = None if key_padding_mask is None else key_padding_mask[:, None, None, :].to(torch.bool)
    if score_transform is not None:
        # padded keys are hidden from the transform as future keys are
        if padding is not None:
            mask = mask.masked_fill(padding, float("-inf"))
        return score_transform(q, scores, mask)
    scores += mask  # in place
    if padding is not None:
        scores.masked_fill_(padding, float("-inf"))
    return scores
