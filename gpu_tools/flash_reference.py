"""A FlashAttention-2-style causal attention without a bias, in Triton: the baseline that
:mod:`gpu_tools.kernel_cost` sets the fused distance-bias kernels' machine code beside.

The forward runs one program per tile of ``BLOCK_M`` queries of one head over the key tiles before its diagonal,
without masks, then the diagonal tile, masked (each in a loop, as FlashAttention-2 loops over its masked tiles, so
that the machine code has a loop body for each); an online softmax in base 2 (``log2(e)`` folded into the scores'
scale, so one fused multiply-add scales and shifts each score) and saves the base-2 log-sum-exp. The backward
runs one program per tile of ``BLOCK_N`` keys over the query tiles at and after its diagonal (the diagonal's
masked), recomputes the probabilities from the log-sum-exp on transposed tiles (keys x queries, so no register
tile is transposed), keeps ``dK`` and ``dV`` in registers and adds ``dQ`` into a float32 buffer with relaxed
atomic adds. Dropout is the fused kernels' own (:func:`kerple_core.attention.fused_kernels.kept`: one 7-round
Philox draw per 16 cells, 8-bit thresholds), so the two do the same random work.

The kernels take contiguous ``[batch, heads, length, head_dim]`` tensors, as many queries as keys, lengths a
multiple of both tiles' sides and head widths a power of two from 16 (one tile of the head's dimensions); the
forward's query tiles a multiple of its key tiles, the backward's key tiles a multiple of its query tiles (the
diagonal then falls in whole tiles): what a baseline needs, not a general attention.
"""

import torch
import triton
import triton.language as tl

from kerple_core.attention.fused import LOG2E, Tiles, dropout_threshold, keep_probability
from kerple_core.attention.fused_kernels import kept, kept_transposed


@triton.jit
def _mm(a, b, IEEE: tl.constexpr):
    """``a @ b`` accumulated in float32; ``IEEE``: float32 operands multiplied in IEEE precision, not TF32."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _rows(X, start, stride_t, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows ``start .. start + BLOCK`` of a head's ``[length, BLOCK_D]`` matrix at ``X``."""
    rows = start + tl.arange(0, BLOCK)
    return tl.load(X + rows[:, None].to(tl.int64) * stride_t + tl.arange(0, BLOCK_D)[None, :])


@triton.jit
def _forward_step(acc, row_max, row_sum, q, K, V, t, start, stride_t, qk_scale, seed, bh, threshold,
                  DIAGONAL: tl.constexpr, HAS_DROPOUT: tl.constexpr, IEEE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One key tile of the online softmax: the running output, row maxima (base 2) and row sums."""
    k = _rows(K, start, stride_t, BLOCK_N, BLOCK_D)
    v = _rows(V, start, stride_t, BLOCK_N, BLOCK_D)
    scores = _mm(q, tl.trans(k), IEEE)
    if DIAGONAL:
        s = start + tl.arange(0, BLOCK_N)
        scores = tl.where(t[:, None] >= s[None, :], scores, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(scores, 1) * qk_scale)
    rescale = tl.exp2(row_max - new_max)
    probabilities = tl.exp2(scores * qk_scale - new_max[:, None])
    row_sum = row_sum * rescale + tl.sum(probabilities, 1)
    if HAS_DROPOUT:
        probabilities = tl.where(kept(seed, bh, t, start, threshold, BLOCK_M, BLOCK_N), probabilities, 0.0)
    acc = acc * rescale[:, None] + _mm(probabilities.to(v.dtype), v, IEEE)
    return acc, new_max, row_sum


@triton.jit
def flash_forward(Q, K, V, Out, LSE, seed, threshold, keep_scale, qk_scale, stride_bh, stride_t, T,
                  HAS_DROPOUT: tl.constexpr, IEEE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """``Out = softmax(Q K^T * scale, causal) V`` (dropped out) and the base-2 log-sum-exp of each query."""
    tl.static_assert(BLOCK_M % BLOCK_N == 0)  # the diagonal in whole key tiles
    m = tl.program_id(0)
    bh = tl.program_id(1)
    head = bh.to(tl.int64) * stride_bh
    first = m * BLOCK_M
    t = first + tl.arange(0, BLOCK_M)
    q = _rows(Q + head, first, stride_t, BLOCK_M, BLOCK_D)
    K += head
    V += head
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, first, BLOCK_N):
        acc, row_max, row_sum = _forward_step(acc, row_max, row_sum, q, K, V, t, start, stride_t, qk_scale, seed,
                                              bh, threshold, False, HAS_DROPOUT, IEEE, BLOCK_M, BLOCK_N, BLOCK_D)
    for start in range(first, tl.minimum(first + BLOCK_M, T), BLOCK_N):  # the diagonal's key tiles
        acc, row_max, row_sum = _forward_step(acc, row_max, row_sum, q, K, V, t, start, stride_t, qk_scale, seed,
                                              bh, threshold, True, HAS_DROPOUT, IEEE, BLOCK_M, BLOCK_N, BLOCK_D)
    out = acc * (keep_scale / row_sum)[:, None]
    tl.store(Out + head + t[:, None].to(tl.int64) * stride_t + tl.arange(0, BLOCK_D)[None, :],
             out.to(Out.dtype.element_ty))
    tl.store(LSE + bh.to(tl.int64) * T + t, row_max + tl.log2(row_sum))


@triton.jit
def _backward_step(grad_k, grad_v, k, v, s, n_start, Q, DO, LSE, Delta, DQ, start, stride_t, qk_scale, seed, bh,
                   threshold, keep_scale, DIAGONAL: tl.constexpr, HAS_DROPOUT: tl.constexpr, IEEE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One query tile of a key tile's gradients, on transposed tiles ``[keys, queries]``: ``dK`` and ``dV``
    accumulated, ``dQ`` (unscaled) added into ``DQ``."""
    t = start + tl.arange(0, BLOCK_M)
    q = _rows(Q, start, stride_t, BLOCK_M, BLOCK_D)
    do = _rows(DO, start, stride_t, BLOCK_M, BLOCK_D)
    lse = tl.load(LSE + t)
    delta = tl.load(Delta + t)
    scores = _mm(k, tl.trans(q), IEEE)
    if DIAGONAL:
        scores = tl.where(t[None, :] >= s[:, None], scores, float("-inf"))
    probabilities = tl.exp2(scores * qk_scale - lse[None, :])
    grad_attended = _mm(v, tl.trans(do), IEEE)
    attended = probabilities
    if HAS_DROPOUT:
        keep = kept_transposed(seed, bh, t, n_start, threshold, BLOCK_M, BLOCK_N)
        attended = tl.where(keep, probabilities, 0.0)
        grad_attended = tl.where(keep, grad_attended * keep_scale, 0.0)
    grad_v += _mm(attended.to(do.dtype), do, IEEE)
    grad_scores = probabilities * (grad_attended - delta[None, :])
    grad_k += _mm(grad_scores.to(q.dtype), q, IEEE)
    grad_q = _mm(tl.trans(k), grad_scores.to(k.dtype), IEEE)  # [dims, queries]
    tl.atomic_add(DQ + t[None, :].to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)[:, None], grad_q, sem="relaxed")
    return grad_k, grad_v


@triton.jit
def flash_backward(Q, K, V, DO, LSE, Delta, DQ, DK, DV, seed, threshold, keep_scale, qk_scale, sm_scale,
                   stride_bh, stride_t, T, HAS_DROPOUT: tl.constexpr, IEEE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """``dK``, ``dV`` of a key tile, and its share of ``dQ / scale`` added into the float32 ``DQ`` ``[B, H, T,
    BLOCK_D]``; ``Delta`` is each query's ``dOut . Out``."""
    tl.static_assert(BLOCK_N % BLOCK_M == 0)  # the diagonal in whole query tiles
    n = tl.program_id(0)
    bh = tl.program_id(1)
    head = bh.to(tl.int64) * stride_bh
    n_start = n * BLOCK_N
    s = n_start + tl.arange(0, BLOCK_N)
    k = _rows(K + head, n_start, stride_t, BLOCK_N, BLOCK_D)
    v = _rows(V + head, n_start, stride_t, BLOCK_N, BLOCK_D)
    Q += head
    DO += head
    LSE += bh.to(tl.int64) * T
    Delta += bh.to(tl.int64) * T
    DQ += bh.to(tl.int64) * T * BLOCK_D
    grad_k = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    grad_v = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for start in range(n_start, tl.minimum(n_start + BLOCK_N, T), BLOCK_M):  # the diagonal's query tiles
        grad_k, grad_v = _backward_step(grad_k, grad_v, k, v, s, n_start, Q, DO, LSE, Delta, DQ, start, stride_t,
                                        qk_scale, seed, bh, threshold, keep_scale, True, HAS_DROPOUT, IEEE,
                                        BLOCK_M, BLOCK_N, BLOCK_D)
    for start in range(n_start + BLOCK_N, T, BLOCK_M):
        grad_k, grad_v = _backward_step(grad_k, grad_v, k, v, s, n_start, Q, DO, LSE, Delta, DQ, start, stride_t,
                                        qk_scale, seed, bh, threshold, keep_scale, False, HAS_DROPOUT, IEEE,
                                        BLOCK_M, BLOCK_N, BLOCK_D)
    rows = s[:, None].to(tl.int64) * stride_t + tl.arange(0, BLOCK_D)[None, :]
    tl.store(DK + head + rows, (grad_k * sm_scale).to(DK.dtype.element_ty))
    tl.store(DV + head + rows, (grad_v * keep_scale).to(DV.dtype.element_ty))


#: the rows (queries or keys) each program of a kernel takes: the forward's a query tile, the backward's a key tile
PROGRAM_ROWS = {"flash_forward": "block_m", "flash_backward": "block_n"}


def launch(name: str, programs: int, batch_heads: int, device, args: tuple, constants: dict, tiles: Tiles) -> None:
    """Launch kernel ``name`` of this module over ``programs`` rows of ``batch_heads`` heads with ``tiles``
    (:mod:`gpu_tools.kernel_cost` replaces it with a recorder, as it does the fused backend's)."""
    grid = (triton.cdiv(programs, getattr(tiles, PROGRAM_ROWS[name])), batch_heads)
    globals()[name][grid](*args, **constants, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
                          num_warps=tiles.num_warps, num_stages=tiles.num_stages)


class _FlashAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, dropout, seed, forward_tiles, backward_tiles):
        batch, heads, length, head_dim = q.shape
        sides = {side for tiles in (forward_tiles, backward_tiles) for side in (tiles.block_m, tiles.block_n)}
        if k.shape != q.shape or v.shape != q.shape or any(length % side for side in sides) or head_dim < 16 \
                or head_dim & (head_dim - 1):
            raise ValueError(f"the baseline takes queries, keys and values of one shape [B, H, T, D], T a multiple of "
                             f"{max(sides)} and D a power of two from 16, not {tuple(q.shape)}, {tuple(k.shape)}")
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out = torch.empty_like(q)
        lse = torch.empty(batch, heads, length, dtype=torch.float32, device=q.device)
        threshold = dropout_threshold(dropout)
        stream = (seed, threshold, 1.0 / keep_probability(dropout) if threshold < 256 else 0.0)
        sm_scale = head_dim ** -0.5
        flags = dict(HAS_DROPOUT=threshold > 0, IEEE=q.dtype == torch.float32, BLOCK_D=head_dim)
        launch("flash_forward", length, batch * heads, q.device,
               (q, k, v, out, lse, *stream, sm_scale * LOG2E, q.stride(1), q.stride(2), length), flags, forward_tiles)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.settings = (stream, sm_scale, flags, backward_tiles)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        stream, sm_scale, flags, tiles = ctx.settings
        batch, heads, length, _ = q.shape
        grad_out = grad_out.contiguous()
        delta = (grad_out.float() * out.float()).sum(-1).contiguous()
        grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        grad_k, grad_v = torch.empty_like(k), torch.empty_like(v)
        launch("flash_backward", length, batch * heads, q.device,
               (q, k, v, grad_out, lse, delta, grad_q, grad_k, grad_v, *stream, sm_scale * LOG2E, sm_scale,
                q.stride(1), q.stride(2), length), flags, tiles)
        return (grad_q * sm_scale).to(q.dtype), grad_k, grad_v, None, None, None, None


def attention(q, k, v, dropout: float = 0.0, seed: int = 0, forward_tiles: Tiles = Tiles(64, 64, 4, 2),
              backward_tiles: Tiles = Tiles(64, 64, 4, 2)):
    """Causal ``softmax(q k^T / sqrt(D))`` (dropped out as the fused kernels drop out) times ``v``, differentiable,
    for ``q``, ``k``, ``v`` ``[B, H, T, D]`` (CUDA tensors, or CPU ones under Triton's interpreter), each kernel with
    its tiles (the forward's query tiles a multiple of its key tiles, the backward's the other way)."""
    return _FlashAttention.apply(q, k, v, float(dropout), int(seed), forward_tiles, backward_tiles)
