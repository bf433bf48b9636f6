"""FlexAttention (``torch.nn.attention.flex_attention``): the bias as a score modification.

A block's bias is never laid out. Its distance kernel reaches the fused kernel as the float32
per-distance values ``[heads, distances]`` that :class:`~kerple_core.attention.distance_bias.DistanceBias`
computes once per forward, read inside the kernel at ``offset + t - s`` and added to the float32
score; a weight kernel's ``W`` multiplies the score there too; a layer's own bias adds its term
(:meth:`~kerple_core.layer_biases.LayerBias.score_term`). Which keys each query sees (the layer's
:class:`~kerple_core.visibility.Visibility`: causality, a window, a chunk) and key padding decide
which tiles of the block mask are skipped or taken whole (computed from tile indices: no ``queries x
keys`` tensor), and give ``-inf`` inside the others through the score
modification (PyTorch 2.13's CPU compiler miscompiles masks that capture tensors beside a score
modification). On CUDA, gradients reach the captured tensors (and through them the kernel's
parameters); on CPU the kernel has no backward, so it serves evaluation only.

On CPU the compiled kernel is given queries and keys at least :data:`CPU_MIN_QK_WIDTH` wide and values a
whole number of :data:`CPU_VALUE_MULTIPLE` wide, widened with zeros (:func:`widened_for_cpu`; the output's
extra columns dropped): PyTorch 2.13's CPU kernel computes ``q k^T`` wrongly for narrower heads with AVX2
code, and with AVX-512 code it was measured wrong for values of 8 at a batch of 2 (docs/design.md,
"FlexAttention on CPU"), silently both.

Score modifications are small pure functions of ``(score, batch, head, query, key)`` over captured
tensors. Offsets are captured as one-element tensors and sizes are dynamic, so one compiled kernel
serves every length and decoding step: a process compiles a bounded number of times
(:func:`compile_report`).
"""

import time
from typing import Callable, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from kerple_core.visibility import Visibility

try:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention, noop_mask
except ImportError:  # PyTorch before 2.5
    BlockMask = flex_attention = noop_mask = None

#: FlexAttention's block of queries and of keys
BLOCK = 128
#: dtypes its compiled kernels take
DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: ``score_mod(score, batch, head, query, key)`` and ``term(batch, head, query, key)``
ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
ScoreTerm = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]

#: compiles of FlexAttention a process allows before dynamo falls back to the eager kernel
RECOMPILE_LIMIT = 64
#: the narrowest head (of queries and keys) the compiled CPU kernel is given: PyTorch 2.13's CPU template
#: multiplies ``q k^T`` with a micro-kernel of 16 keys whose path for heads narrower than 24 dimensions
#: (a multiple of the vector's floats) reads and stores 16 keys whatever a last block holds; with AVX2's
#: 8-float vectors a last block of 8 keys reads and writes past its row: wrong outputs, or NaN, at 8, 24,
#: ..., 120 keys. Widening is harmless where the kernel is right; the test of every vector width keeps it honest
CPU_MIN_QK_WIDTH = 24
#: the compiled CPU kernel is given values a whole number of this many dimensions wide (AVX-512's vector of
#: floats): with AVX-512 code, values of 8 (half a vector) at a batch of 2 gave outputs off by up to 0.4 from 9
#: keys on, where values of 16, 32 and 64 and the same calls with AVX2 code were right; widening is exact (zero
#: columns, dropped from the output), the test of every vector width keeps it honest
CPU_VALUE_MULTIPLE = 16
#: use ``torch.compile``d FlexAttention (False: the eager one, which materialises the scores)
COMPILED = True
_compiled_flex = None
_compiles = {"count": 0, "seconds": 0.0}


def available() -> bool:
    return flex_attention is not None


# ------------------------------------------------------------------ score modifications


def distance_of(offset: Tensor) -> Callable[[Tensor, Tensor], Tensor]:
    """Query ``t`` and key ``s`` of a block are ``offset + t - s`` apart (clamped at 0: future keys
    are masked anyway)."""
    return lambda query, key: (query + offset[0] - key).clamp(min=0)


def distance_bias(values: Tensor, offset: Tensor) -> ScoreMod:
    """``score + B_h(d)``, ``values`` ``[heads, distances]`` (made contiguous: a captured tensor's
    strides are part of the compiled kernel, and PyTorch 2.13's CPU compiler fails on some)."""
    values = values.contiguous()
    distance = distance_of(offset)
    return lambda score, b, h, query, key: score + values[h, distance(query, key)]


def weighted_distance_bias(values: Tensor, weights: Tensor, offset: Tensor) -> ScoreMod:
    """``score * W_h(d) + B_h(d)``."""
    values, weights = values.contiguous(), weights.contiguous()
    distance = distance_of(offset)

    def score_mod(score, b, h, query, key):
        d = distance(query, key)
        return score * weights[h, d] + values[h, d]
    return score_mod


def plus(score_mod: ScoreMod, term: ScoreTerm) -> ScoreMod:
    """``score_mod`` and then a layer's own bias ``term``."""
    return lambda score, b, h, query, key: score_mod(score, b, h, query, key) + term(b, h, query, key)


def rows_scaled(score_mod: ScoreMod, factor: Tensor) -> ScoreMod:
    """``score_mod`` with its additive terms (its value at a zero score) multiplied by ``factor[h, query]``:
    ``score * W + f B`` for ``score * W + B``."""
    excess = (factor - 1).contiguous()

    def score_mod_scaled(score, b, h, query, key):
        return score_mod(score, b, h, query, key) + excess[h, query] * score_mod(torch.zeros_like(score), b, h,
                                                                                  query, key)
    return score_mod_scaled


def masked(score_mod: ScoreMod, seen: Callable) -> ScoreMod:
    """``score_mod``'s score where ``seen``, else ``-inf``."""
    return lambda score, b, h, query, key: torch.where(seen(b, h, query, key), score_mod(score, b, h, query, key),
                                                       float("-inf"))


def visible(visibility: Visibility, offset: int, first_query: int, device, padding: Optional[Tensor]):
    """The mask of a block whose query ``t``, at position ``first_query + t``, is ``offset + t - s``
    positions after key ``s``: key ``s`` is visible if ``visibility`` lets the query see it (``0 <= offset
    + t - s``, within a window by distance, after the first key of a rule by position), and is not
    padding (``padding`` ``[batch, keys]``, True at padding)."""
    # captured tensors, not Python numbers or booleans, which the CPU compiler mishandles in masks
    offset_at = torch.full((1,), offset, dtype=torch.int64, device=device)
    window = torch.full((1,), visibility.window, dtype=torch.int64, device=device)
    first_query_at = torch.full((1,), first_query, dtype=torch.int64, device=device)
    first_key = visibility.first_key(device) if visibility.by_position else None
    keep = None if padding is None else (~padding).to(torch.int8)

    def seen_by(b, h, query, key):
        d = query + offset_at[0] - key
        seen = d >= 0
        if visibility.window:
            seen = seen & (d < window[0])
        if first_key is not None:
            position = query + first_query_at[0]
            seen = seen & (position - d >= first_key(position))
        if padding is not None:
            seen = seen & (keep[b, key] > 0)
        return seen
    return seen_by


# ------------------------------------------------------------------ block mask


class Mask(NamedTuple):
    """Which keys each query sees: ``tiles``, FlexAttention's block mask (tiles skipped, tiles seen
    whole), and ``visible(batch, head, query, key)``, applied within the other tiles."""

    tiles: "BlockMask"
    visible: Callable


def block_mask(visibility: Visibility, num_queries: int, num_keys: int, offset: int, first_query: int, device,
               padding: Optional[Tensor] = None) -> Mask:
    """The mask of a block of queries (query ``t`` at position ``first_query + t``, ``offset + t - s``
    positions after key ``s``): its tiles, computed per ``BLOCK x BLOCK`` tile from its extreme positions
    (exactly ``num_queries x num_keys``, as FlexAttention requires), and :func:`visible`. A query at ``i``
    sees the keys ``f(i) .. i`` and ``f`` never decreases (:class:`~kerple_core.visibility.Visibility`), so
    a tile of queries ``q0 .. q1`` and keys ``k0 .. k1`` is skipped unless ``k0 <= q1`` and ``k1 >= f(q0)``,
    and whole where ``k1 <= q0`` and ``k0 >= f(q1)``: the tiles beyond a window or of another chunk are
    skipped."""
    query_tiles, key_tiles = -(-num_queries // BLOCK), -(-num_keys // BLOCK)
    first_queries = first_query + torch.arange(query_tiles, device=device) * BLOCK
    last_queries = (first_queries + BLOCK - 1).clamp(max=first_query + num_queries - 1)
    first_keys = first_query - offset + torch.arange(key_tiles, device=device) * BLOCK
    last_keys = (first_keys + BLOCK - 1).clamp(max=first_query - offset + num_keys - 1)
    seen_from = visibility.first_key(device)
    some = (first_keys[None, :] <= last_queries[:, None]) & (last_keys[None, :] >= seen_from(first_queries)[:, None])
    every = (last_keys[None, :] <= first_queries[:, None]) & (first_keys[None, :] >= seen_from(last_queries)[:, None])
    if padding is not None:  # padded keys: the mask is evaluated in every tile
        every = torch.zeros_like(every)
    partial = some & ~every

    def indexed(tiles: Tensor) -> Tuple[Tensor, Tensor]:
        counts = tiles.sum(-1, dtype=torch.int32)
        # the selected tiles first, in order
        order = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return counts[None, None], order[None, None]

    tiles = BlockMask.from_kv_blocks(*indexed(partial), *indexed(every), BLOCK_SIZE=BLOCK, mask_mod=noop_mask,
                                     seq_lengths=(num_queries, num_keys))
    return Mask(tiles, visible(visibility, offset, first_query, device, padding))


# ------------------------------------------------------------------ attention


def attend(q: Tensor, k: Tensor, v: Tensor, score_mod: ScoreMod, mask: "Mask") -> Tensor:
    """``softmax(score_mod(q k^T)) v`` over the visible keys of ``mask``; ``q`` ``[B, H, T, D]`` already scaled."""
    score_mod = masked(score_mod, mask.visible)
    mask = mask.tiles
    value_width = v.size(-1)
    if COMPILED:
        q, k, v = widened_for_cpu(q, k, v)
    if not COMPILED or is_fake(q):  # FakeTensor propagation is what compiling would do
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=mask, scale=1.0)[..., :value_width]
    before = _graphs()
    start = time.perf_counter()
    # sizes 0 and 1 (one tile, one query, a batch of one) are specialised: a few compiles, more than
    # dynamo's default limit of 8 only in a process that runs many models; the limit is raised for this
    # call alone, so torch's settings stay the process's own
    limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    with torch._dynamo.config.patch(recompile_limit=limit):
        out = _flex()(q, k, v, score_mod=score_mod, block_mask=mask, scale=1.0)
    if _graphs() > before:
        _compiles["count"] += _graphs() - before
        _compiles["seconds"] += time.perf_counter() - start
    return out[..., :value_width]


def widened_for_cpu(q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """On CPU, ``q`` and ``k`` with zeros appended to heads narrower than :data:`CPU_MIN_QK_WIDTH` (``q k^T``
    unchanged: the compiled kernel then takes its inner-product path, right on every CPU), and ``v`` with
    zero columns up to a whole number of :data:`CPU_VALUE_MULTIPLE` (the output's first ``v.size(-1)``
    columns unchanged, the others zero); elsewhere, and where no widening is needed, as they are."""
    if q.device.type != "cpu":
        return q, k, v
    width = q.size(-1)
    if width < CPU_MIN_QK_WIDTH:
        pad = (0, CPU_MIN_QK_WIDTH - width)
        q, k = F.pad(q, pad), F.pad(k, pad)
    missing = -v.size(-1) % CPU_VALUE_MULTIPLE
    if missing:
        v = F.pad(v, (0, missing))
    return q, k, v


def compile_report() -> Tuple[int, float]:
    """Compilations of FlexAttention in this process, and the seconds spent in the calls that compiled."""
    return _compiles["count"], _compiles["seconds"]


def _flex():
    global _compiled_flex
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=True)
    return _compiled_flex


def _graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]

