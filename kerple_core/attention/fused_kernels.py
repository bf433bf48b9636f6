"""The Triton kernels of the fused distance-bias attention (:mod:`kerple_core.attention.fused`).

FlashAttention-2's structure (Dao, "FlashAttention-2", 2023, §3.1-3.2): the forward runs one program per tile of
``BLOCK_M`` queries of one head over the key tiles its queries see, with an online softmax; the backward runs one
program per tile of ``BLOCK_N`` keys over the query tiles that see them, recomputes each tile's probabilities
from the saved log-sum-exp, keeps ``dK``, ``dV`` and the key gates' sums in registers and adds ``dQ`` and the query
gates' sums into float32 buffers (relaxed atomic adds). The backward works on transposed tiles (keys x queries,
as Triton's fused-attention tutorial does), so that no register tile is transposed.

The logit of query ``t`` and key ``s`` (``d = offset + t - s`` positions apart) is

    ``x_ts = (q_t . k_s) * W(d) + B(d) + c[offset + t] - c[s]``

with ``B`` and ``W`` read from float32 tables ``[heads, distances]`` (``W`` only for a weight kernel), or, for a bias
linear in the distance (``LINEAR``: ALiBi's ``B(d) = -m d``), ``B`` computed from the head's slope ``m``, and ``c`` a
per-key float32 state (the Forgetting Transformer's cumulative log forget gates); ``-inf`` where ``d < 0``,
``d >= limit`` (the table's length, or an attention window's) or ``s`` is padding. The kernels exponentiate in base
2: the host scales ``B``, ``W`` and ``c`` by ``log2(e)`` (without a weight kernel, the scores are multiplied by it
in the same fused multiply-add that adds ``B``), and the log-sum-exp is saved in base 2.

A linear bias is split into a key's term ``m (s - base)``, added to each cell, and a query's term ``-m (offset + t -
base)``, constant along a row, which the softmax does not see: the forward subtracts it from the saved log-sum-exp
and the backward adds it to the log-sum-exp it reads, once a row. ``base`` is the program's first query (forward)
or key (backward), so that both terms stay small where the probabilities are not: a cell costs one add beyond
attention without a bias, and reads no table.

Tiles wholly outside what their queries see are never visited; tiles wholly inside it (all but the diagonal's and
a window's edge at long lengths) are computed without masks. Dropout follows FlashAttention-2: one 7-round
Philox-4x32 draw gives 16 cells 8 random bits each, a cell kept where its byte is at least ``threshold``
(``p`` rounded to a multiple of 1/256). The draw's counter is (the cell's group of 16 keys, its query, its head)
and its key the call's seed, so the stream does not depend on the tiles, the backward regenerates the forward's
cells, and no two heads or calls share one.

The per-distance gradients of ``B`` (and ``W``) are the sums of the logits' gradients along each tile's diagonals.
A key tile's program visits query tiles in order, each ``BLOCK`` distances further; a square tile's lower
triangle (``t >= s`` within the tile) and the next tile's upper triangle fall on the same ``BLOCK`` distances, so
each segment of distances is complete after two tiles and is written once, without atomics, into the program's
own row (summed in a fixed order after the kernel), or added into its head's row.

Offsets that can pass ``2 ** 31`` elements (a head's start in a long evaluation) are computed in 64 bits.
"""

import math

import triton
import triton.language as tl

#: ``log2(e)``: the kernels exponentiate in base 2
LOG2E = tl.constexpr(math.log2(math.e))
#: zeros on either side of each row of a table, more than a tile's queries and keys together: a masked tile reads its
#: cells without a mask (those it masks fall on the zeros)
TABLE_PAD = tl.constexpr(256)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` accumulated in float32: float32 operands in IEEE precision (not TF32); ``UPCAST``: half
    operands multiplied as float32 (Triton's interpreter computes bfloat16 products wrongly; exact either way)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def head_start(b, h, stride_b, stride_h):
    """The offset, in 64 bits, of head ``h`` of batch element ``b`` of a ``[B, H, ...]`` tensor."""
    return b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h


@triton.jit
def _tile(X, start, stride_row, num_rows, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr,
          ROWS_MASKED: tl.constexpr):
    """Rows ``start .. start + BLOCK`` of a head's ``[rows, D]`` matrix at ``X`` (its last dimension contiguous),
    ``[BLOCK, BLOCK_D]``, 0 past ``num_rows`` rows (checked only where ``ROWS_MASKED``) and ``D`` dimensions."""
    rows = tl.arange(0, BLOCK)
    j = tl.arange(0, BLOCK_D)
    pointers = X + tl.cast(start, tl.int64) * stride_row + rows[:, None] * stride_row + j[None, :]
    if ROWS_MASKED:
        return tl.load(pointers, mask=((start + rows)[:, None] < num_rows) & (j[None, :] < D), other=0.0)
    elif D < BLOCK_D:
        return tl.load(pointers, mask=j[None, :] < D, other=0.0)
    else:
        return tl.load(pointers)


@triton.jit
def _store_tile(X, start, stride_row, num_rows, value, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
                D: tl.constexpr):
    rows = tl.arange(0, BLOCK)
    j = tl.arange(0, BLOCK_D)
    tl.store(X + tl.cast(start, tl.int64) * stride_row + rows[:, None] * stride_row + j[None, :],
             value.to(X.dtype.element_ty), mask=((start + rows)[:, None] < num_rows) & (j[None, :] < D))


@triton.jit
def table_rows(first, ROW):
    """Where rows of cells start in a table's four shifted copies (``[4, ROW]`` a head, copy ``k`` holding the padded
    row from its cell ``k`` on, ``ROW`` a multiple of 4): a row whose first cell is ``first`` starts at a multiple of 4
    in the copy ``first % 4``, so that its cells, 16-byte aligned, are read 4 at a time. ``first`` may be negative
    where the tiles' starts (multiples of 4) bring every cell read into the row."""
    shift = first & 3
    return shift * ROW + first - shift


@triton.jit
def _cells(table, rows, start, LENGTH: tl.constexpr):
    """``[len(rows), LENGTH]`` pointers to a tile's cells in a table read along its rows: row ``i`` from
    :func:`table_rows`' ``rows[i]`` moved ``start`` (a multiple of 4) cells on."""
    first = tl.multiple_of(rows + start, 4)
    return (table + first)[:, None] + tl.arange(0, LENGTH)[None, :]


@triton.jit
def _logits(scores, t, s, bias, weights, gates, padding, T, S, offset, limit, MASKED: tl.constexpr,
            LINEAR: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_GATES: tl.constexpr, HAS_PADDING: tl.constexpr):
    """The base-2 logits of the cells of queries ``t`` and keys ``s`` (index tensors broadcast against each other:
    ``[M, 1]`` and ``[1, N]``, or transposed), ``-inf`` where unseen, and the weights ``W(d)`` (weight kernel;
    else the scalar ``log2(e)``). ``bias`` and ``weights``: the cells' pointers into the tables (:func:`_cells`),
    or, ``LINEAR``, ``bias`` the key's term ``m (s - base)`` (the logits leave out the query's). ``MASKED``: the
    tile may hold unseen cells (else only padding may be)."""
    if MASKED:
        d = offset + t - s
        seen = (d >= 0) & (d < limit) & (t < T) & (s < S)
    if not LINEAR:  # a masked tile's unseen cells read the tables' padding
        bias = tl.load(bias)
    if HAS_WEIGHT:
        weight = tl.load(weights)
    else:
        weight = LOG2E
    logits = scores * weight + bias
    if HAS_GATES:
        if MASKED:
            logits += tl.load(gates + offset + t, mask=t < T, other=0.0) - tl.load(gates + s, mask=s < S, other=0.0)
        else:
            logits += tl.load(gates + offset + t) - tl.load(gates + s)
    if HAS_PADDING:
        not_padded = tl.load(padding + s, mask=s < S, other=1) == 0
        if MASKED:
            seen = seen & not_padded
        else:
            logits = tl.where(not_padded, logits, float("-inf"))
    if MASKED:
        logits = tl.where(seen, logits, float("-inf"))
    return logits, weight


@triton.jit
def _random_words(seed, bh, t, groups):
    """Philox-4x32-7 keyed by ``seed`` at counters ``(group, query, head, 0)``: its four words, ``[..., 4]`` (``t`` and
    ``groups`` broadcast against each other)."""
    c0 = groups + t * 0
    c1 = t + groups * 0
    c2 = c0 * 0 + bh
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, c2, c2 * 0, n_rounds=7)
    words = tl.join(tl.join(r0, r2), tl.join(r1, r3))  # [..., 2, 2]: word 2 i + j at [i, j]
    return tl.reshape(words, words.shape[:-2] + [4])


@triton.jit
def kept(seed, bh, t, start, threshold, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``[BLOCK_M, BLOCK_N]``: dropout keeps cell (``t``, ``start + n``) of head ``bh``. Key ``16 g + 4 w + i``'s byte
    is byte ``i`` of word ``w`` of group ``g``'s draw."""
    groups = start // 16 + tl.arange(0, BLOCK_N // 16)
    words = _random_words(seed, bh, t[:, None], groups[None, :])  # [M, G, 4]
    random = (words[:, :, :, None] >> (8 * tl.arange(0, 4))[None, None, None, :]) & 255  # [M, G, 4, 4]
    return tl.reshape(random, [BLOCK_M, BLOCK_N]).to(tl.int32) >= threshold


@triton.jit
def kept_transposed(seed, bh, t, start, threshold, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``[BLOCK_N, BLOCK_M]``: :func:`kept`'s cells with the keys first."""
    groups = start // 16 + tl.arange(0, BLOCK_N // 16)
    words = _random_words(seed, bh, t[None, :], groups[:, None])  # [G, M, 4]
    random = (words[:, :, :, None] >> (8 * tl.arange(0, 4))[None, None, None, :]) & 255  # [G, M, 4, 4]
    return tl.reshape(tl.permute(random, (0, 2, 3, 1)), [BLOCK_N, BLOCK_M]).to(tl.int32) >= threshold


@triton.jit
def keep_mask_kernel(Out, seed, T, S, threshold, TRANSPOSED: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    """Writes the cells dropout keeps in one head ``[T, S]`` (tests compare it with the kernels' dropout), computed in
    the forward's orientation or, ``TRANSPOSED``, in the backward's."""
    m = tl.program_id(0)
    n = tl.program_id(1)
    bh = tl.program_id(2)
    t = m * BLOCK_M + tl.arange(0, BLOCK_M)
    s = n * BLOCK_N + tl.arange(0, BLOCK_N)
    out = Out + bh.to(tl.int64) * T * S
    if TRANSPOSED:
        keep = kept_transposed(seed, bh, t, n * BLOCK_N, threshold, BLOCK_M, BLOCK_N)
        tl.store(out + t[None, :] * S + s[:, None], keep.to(tl.int8), mask=(t[None, :] < T) & (s[:, None] < S))
    else:
        keep = kept(seed, bh, t, n * BLOCK_N, threshold, BLOCK_M, BLOCK_N)
        tl.store(out + t[:, None] * S + s[None, :], keep.to(tl.int8), mask=(t[:, None] < T) & (s[None, :] < S))


@triton.jit
def _three_ranges(lo, hi, full_lo, full_hi):
    """Tile starts ``[lo, hi)`` split as ``[lo, a)``, ``[a, b)``, ``[b, hi)``: ``[a, b)`` those wholly seen, within
    ``[full_lo, full_hi)``."""
    b = tl.maximum(full_hi, lo)
    a = tl.minimum(tl.maximum(full_lo, lo), b)
    return a, b


@triton.jit
def _forward_tile(acc, row_max, row_sum, q, K, V, start, t, sks, svs, bias_row, slope, weight_row, rows, gates, padding,
                  seed, bh, threshold, T, S, offset, limit, base, MASKED: tl.constexpr, LINEAR: tl.constexpr,
                  HAS_WEIGHT: tl.constexpr, HAS_GATES: tl.constexpr, HAS_PADDING: tl.constexpr,
                  HAS_DROPOUT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr):
    s = start + tl.arange(0, BLOCK_N)
    k = _tile(K, start, sks, S, BLOCK_N, BLOCK_D, D, MASKED)
    v = _tile(V, start, svs, S, BLOCK_N, BLOCK_D, D, MASKED)
    if LINEAR:  # bias_row: the slope times the keys' places in a tile
        bias = (bias_row + slope * (start - base).to(tl.float32))[None, :]
    else:  # the tables from the last distance to the first: -d rises along the keys
        bias = _cells(bias_row, rows, start, BLOCK_N)
    weights = _cells(weight_row, rows, start, BLOCK_N) if HAS_WEIGHT else weight_row
    logits, _ = _logits(_dot(q, tl.trans(k), IEEE, UPCAST), t[:, None], s[None, :], bias, weights, gates,
                        padding, T, S, offset, limit, MASKED, LINEAR, HAS_WEIGHT, HAS_GATES, HAS_PADDING)
    new_max = tl.maximum(row_max, tl.max(logits, 1))
    if MASKED or HAS_PADDING:
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # a row that has seen nothing yet
    else:
        shift = new_max
    rescale = tl.exp2(row_max - shift)
    probabilities = tl.exp2(logits - shift[:, None])
    row_sum = row_sum * rescale + tl.sum(probabilities, 1)
    if HAS_DROPOUT:
        probabilities = tl.where(kept(seed, bh, t, start, threshold, BLOCK_M, BLOCK_N), probabilities, 0.0)
    acc = acc * rescale[:, None] + _dot(probabilities.to(v.dtype), v, IEEE, UPCAST)
    return acc, new_max, row_sum


@triton.jit
def forward_kernel(Q, K, V, Out, LSE, Bias, Weight, Gates, Padding, seed, threshold, keep_scale,
                   sqb, sqh, sqt, skb, skh, sks, svb, svh, svs, sob, soh, sot,
                   H, T, S, N, row_length, offset, limit,
                   LINEAR: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_GATES: tl.constexpr, HAS_PADDING: tl.constexpr,
                   HAS_DROPOUT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr):
    tl.static_assert(not (LINEAR and HAS_WEIGHT))
    tl.static_assert(BLOCK_N % 4 == 0)  # key tiles start at multiples of 4: table_rows' copy holds for each
    m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    first = m * BLOCK_M
    t = first + tl.arange(0, BLOCK_M)
    q = _tile(Q + head_start(b, h, sqb, sqh), first, sqt, T, BLOCK_M, BLOCK_D, D, True)
    K += head_start(b, h, skb, skh)
    V += head_start(b, h, svb, svh)
    base = offset + first  # a linear bias's terms: the key's m (s - base), the query's -m (offset + t - base)
    if LINEAR:
        slope = tl.load(Bias + h)
        bias_row = slope * tl.arange(0, BLOCK_N).to(tl.float32)
    else:
        slope = 0.0
        bias_row = Bias + h * 4 * row_length
    weight_row = Weight + h * 4 * row_length
    # the tables from the last distance to the first: a query's cells start at -d of the first key's distance d
    rows = table_rows(TABLE_PAD + N - 1 - offset - t, row_length)
    gates = Gates + bh.to(tl.int64) * S
    padding = Padding + b.to(tl.int64) * S
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # key tiles seen: from the window's first key to the last query's own; wholly seen: those after the last
    # query's window starts and before the first query's own key, where the query tile is whole
    last = tl.minimum(first + BLOCK_M, T) - 1
    lo = tl.maximum(0, offset + first - limit + 1) // BLOCK_N * BLOCK_N
    hi = tl.minimum(S, offset + last + 1)
    full_lo = tl.cdiv(tl.maximum(0, offset + first + BLOCK_M - limit), BLOCK_N) * BLOCK_N
    full_hi = tl.where(first + BLOCK_M <= T, tl.minimum(offset + first + 1, S) // BLOCK_N * BLOCK_N, lo)
    a, b_ = _three_ranges(lo, hi, full_lo, full_hi)
    for part in tl.static_range(3):  # [lo, a) and [b_, hi) masked, [a, b_) not
        for start in range(lo if part == 0 else (a if part == 1 else b_), a if part == 0 else (b_ if part == 1 else hi),
                           BLOCK_N):
            acc, row_max, row_sum = _forward_tile(
                acc, row_max, row_sum, q, K, V, start, t, sks, svs, bias_row, slope, weight_row, rows, gates, padding,
                seed, bh, threshold, T, S, offset, limit, base, part != 1, LINEAR, HAS_WEIGHT, HAS_GATES,
                HAS_PADDING, HAS_DROPOUT, IEEE, UPCAST, BLOCK_M, BLOCK_N, BLOCK_D, D)
    seen_any = row_sum > 0
    sums = tl.where(seen_any, row_sum, 1.0)
    out = acc * (keep_scale / sums)[:, None]
    # a row that sees no key attends to nothing: its log-sum-exp is +inf, so its recomputed probabilities are 0
    lse = tl.where(seen_any, row_max + tl.log2(sums), float("inf"))
    if LINEAR:
        lse -= slope * (offset + t - base).to(tl.float32)
    _store_tile(Out + head_start(b, h, sob, soh), first, sot, T, out, BLOCK_M, BLOCK_D, D)
    tl.store(LSE + bh.to(tl.int64) * T + t, lse, mask=t < T)


@triton.jit
def _diagonal_segments(x, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """``x`` ``[BLOCK_N, BLOCK_M]`` (keys x queries, ``BLOCK_N`` one or two ``BLOCK_M``) summed along its diagonals,
    as three ``[BLOCK_M]`` segments of distances: ``c - 2 BLOCK_M``, ``c - BLOCK_M`` and ``c`` (``c`` in ``[0,
    BLOCK_M)``) from the distance of the tile's first key and first query (the first, zeros for a square tile)."""
    i = tl.arange(0, BLOCK_N)[:, None]
    c = tl.arange(0, BLOCK_M)[None, :]
    within = i % BLOCK_M + c  # cell (key i, query within % BLOCK_M): c - BLOCK_M * back from the first's distance
    sheared = tl.gather(x, within % BLOCK_M, 1)
    back = i // BLOCK_M + (within >= BLOCK_M)
    near = tl.sum(tl.where(back == 0, sheared, 0.0), 0)
    if BLOCK_N == BLOCK_M:
        far = tl.zeros([BLOCK_M], tl.float32)
    else:
        far = tl.sum(tl.where(back == 2, sheared, 0.0), 0)
    return far, tl.sum(sheared, 0) - near - far, near


@triton.jit
def _carried(row, segments, carry, base, N, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
             ROW_PER_PROGRAM: tl.constexpr):
    """Adds the segment of distances a query tile completes (``base - BLOCK_N + [0, BLOCK_M)``, ``base`` the distance
    of its first key and first query) and returns what is carried to the next query tiles: the segments this tile
    began (``(far, middle)`` carried: the next ``BLOCK_N / BLOCK_M`` segments' sums so far)."""
    far, middle, near = segments
    first, second = carry
    rows = tl.arange(0, BLOCK_M)
    if BLOCK_N == BLOCK_M:
        _add_segment(row, base - BLOCK_M + rows, first + middle, N, ROW_PER_PROGRAM)
        return near, second
    else:
        _add_segment(row, base - 2 * BLOCK_M + rows, first + far, N, ROW_PER_PROGRAM)
        return second + middle, near


@triton.jit
def _backward_tile(grad_k, grad_v, grad_key_gates, carry_bias, carry_weight, k, v, Q, DO, LSE, Delta, DQ, DGateQ,
                   grad_row, grad_weight_row, start, s, n_start, sqt, sdt, bias_row, slope, weight_row, rows, gates,
                   padding, seed, bh, threshold, keep_scale, T, S, N, offset, limit,
                   MASKED: tl.constexpr, LINEAR: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_GATES: tl.constexpr,
                   HAS_PADDING: tl.constexpr, HAS_DROPOUT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                   BIAS_GRAD: tl.constexpr, ROW_PER_PROGRAM: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr):
    t = start + tl.arange(0, BLOCK_M)
    q = _tile(Q, start, sqt, T, BLOCK_M, BLOCK_D, D, MASKED)
    do = _tile(DO, start, sdt, T, BLOCK_M, BLOCK_D, D, MASKED)
    if MASKED:
        lse = tl.load(LSE + t, mask=t < T, other=float("inf"))
        delta = tl.load(Delta + t, mask=t < T, other=0.0)
    else:
        lse = tl.load(LSE + t)
        delta = tl.load(Delta + t)
    if LINEAR:  # the query's term, which the logits leave out
        lse += slope * (offset + t - n_start).to(tl.float32)
        bias = bias_row
    else:
        bias = _cells(bias_row, rows, start, BLOCK_M)
    weights = _cells(weight_row, rows, start, BLOCK_M) if HAS_WEIGHT else weight_row
    scores = _dot(k, tl.trans(q), IEEE, UPCAST)  # [keys, queries]
    logits, weight = _logits(scores, t[None, :], s[:, None], bias, weights, gates, padding, T, S, offset, limit,
                             MASKED, LINEAR, HAS_WEIGHT, HAS_GATES, HAS_PADDING)
    probabilities = tl.exp2(logits - lse[None, :])
    grad_attended = _dot(v, tl.trans(do), IEEE, UPCAST)
    attended = probabilities
    if HAS_DROPOUT:
        keep = kept_transposed(seed, bh, t, n_start, threshold, BLOCK_M, BLOCK_N)
        attended = tl.where(keep, probabilities, 0.0)
        grad_attended = tl.where(keep, grad_attended * keep_scale, 0.0)
    grad_v += _dot(attended.to(do.dtype), do, IEEE, UPCAST)
    grad_logits = probabilities * (grad_attended - delta[None, :])
    if HAS_WEIGHT:
        grad_scores = grad_logits * weight  # base 2: the host divides dQ and dK by log2(e)
    else:
        grad_scores = grad_logits
    grad_k += _dot(grad_scores.to(q.dtype), q, IEEE, UPCAST)
    j = tl.arange(0, BLOCK_D)
    grad_q = _dot(tl.trans(k), grad_scores.to(k.dtype), IEEE, UPCAST)  # [dims, queries]
    tl.atomic_add(DQ + t[None, :].to(tl.int64) * D + j[:, None], grad_q, mask=(t[None, :] < T) & (j[:, None] < D),
                  sem="relaxed")
    if HAS_GATES:
        tl.atomic_add(DGateQ + t, tl.sum(grad_logits, 0), mask=t < T, sem="relaxed")
        grad_key_gates -= tl.sum(grad_logits, 1)
    if BIAS_GRAD:
        # distances offset + t - s: each query tile completes the segment the tiles before it began
        base = offset + start - n_start
        carry_bias = _carried(grad_row, _diagonal_segments(grad_logits, BLOCK_N, BLOCK_M), carry_bias, base, N,
                              BLOCK_N, BLOCK_M, ROW_PER_PROGRAM)
        if HAS_WEIGHT:
            carry_weight = _carried(grad_weight_row, _diagonal_segments(grad_logits * scores, BLOCK_N, BLOCK_M),
                                    carry_weight, base, N, BLOCK_N, BLOCK_M, ROW_PER_PROGRAM)
    return grad_k, grad_v, grad_key_gates, carry_bias, carry_weight


@triton.jit
def _add_segment(row, distances, values, N, ROW_PER_PROGRAM: tl.constexpr):
    """Adds ``values`` at ``distances`` (those in ``[0, N)``) of a per-distance gradient's row: written once where the
    row is the program's own, added atomically (relaxed) where it is its head's."""
    inside = (distances >= 0) & (distances < N)
    if ROW_PER_PROGRAM:
        tl.store(row + distances, values, mask=inside)
    else:
        tl.atomic_add(row + distances, values, mask=inside, sem="relaxed")


@triton.jit
def backward_kernel(Q, K, V, DO, LSE, Delta, DQ, DK, DV, DGateQ, DGateK, DBias, DWeight, sgb, sgh, sgn,
                    Bias, Weight, Gates, Padding, seed, threshold, keep_scale,
                    sqb, sqh, sqt, skb, skh, sks, svb, svh, svs, sdb, sdh, sdt,
                    H, T, S, N, row_length, offset, limit,
                    LINEAR: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_GATES: tl.constexpr,
                    HAS_PADDING: tl.constexpr, HAS_DROPOUT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                    BIAS_GRAD: tl.constexpr, ROW_PER_PROGRAM: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr):
    tl.static_assert(not (LINEAR and (HAS_WEIGHT or BIAS_GRAD)))
    tl.static_assert((BLOCK_N == BLOCK_M) | (BLOCK_N == 2 * BLOCK_M))  # whole segments of distances
    tl.static_assert(BLOCK_M % 4 == 0)  # query tiles start at multiples of 4: table_rows' copy holds for each
    n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    n_start = n * BLOCK_N
    s = n_start + tl.arange(0, BLOCK_N)
    k = _tile(K + head_start(b, h, skb, skh), n_start, sks, S, BLOCK_N, BLOCK_D, D, True)
    v = _tile(V + head_start(b, h, svb, svh), n_start, svs, S, BLOCK_N, BLOCK_D, D, True)
    Q += head_start(b, h, sqb, sqh)
    DO += head_start(b, h, sdb, sdh)
    rows = bh.to(tl.int64) * T
    LSE += rows
    Delta += rows
    DGateQ += rows
    DQ += rows * D
    if LINEAR:  # bias_row: the key's term of a linear bias, m (s - n_start)
        slope = tl.load(Bias + h)
        bias_row = (slope * (s - n_start).to(tl.float32))[:, None]
    else:
        slope = 0.0
        bias_row = Bias + h * 4 * row_length
    weight_row = Weight + h * 4 * row_length
    rows = table_rows(TABLE_PAD + offset - s, row_length)  # a key's cells start at the first query's distance
    gates = Gates + bh.to(tl.int64) * S
    padding = Padding + b.to(tl.int64) * S
    grad_row = DBias + (b.to(tl.int64) * sgb + h * sgh + n * sgn) * N
    grad_weight_row = DWeight + (b.to(tl.int64) * sgb + h * sgh + n * sgn) * N
    grad_k = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    grad_v = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    grad_key_gates = tl.zeros([BLOCK_N], tl.float32)
    nothing = tl.zeros([BLOCK_M], tl.float32)
    carry_bias = (nothing, nothing)
    carry_weight = (nothing, nothing)
    # query tiles that see these keys: from the first at or after the tile's first key to the last whose window
    # still holds its last key; wholly: from the first at or after its last key, where the key tile is whole
    lo = tl.maximum(0, n_start - offset) // BLOCK_M * BLOCK_M
    hi = tl.minimum(T, n_start + BLOCK_N - 1 + limit - offset)
    full_lo = tl.cdiv(tl.maximum(0, n_start + BLOCK_N - 1 - offset), BLOCK_M) * BLOCK_M
    full_hi = tl.where(n_start + BLOCK_N <= S, tl.minimum(T, limit - offset + n_start) // BLOCK_M * BLOCK_M, lo)
    a, b_ = _three_ranges(lo, hi, full_lo, full_hi)
    for part in tl.static_range(3):  # [lo, a) and [b_, hi) masked, [a, b_) not
        for start in range(lo if part == 0 else (a if part == 1 else b_), a if part == 0 else (b_ if part == 1 else hi),
                           BLOCK_M):
            grad_k, grad_v, grad_key_gates, carry_bias, carry_weight = _backward_tile(
                grad_k, grad_v, grad_key_gates, carry_bias, carry_weight, k, v, Q, DO, LSE, Delta, DQ, DGateQ,
                grad_row, grad_weight_row, start, s, n_start, sqt, sdt, bias_row, slope, weight_row, rows, gates,
                padding, seed, bh, threshold, keep_scale, T, S, N, offset, limit, part != 1, LINEAR, HAS_WEIGHT, HAS_GATES,
                HAS_PADDING, HAS_DROPOUT, IEEE, UPCAST, BIAS_GRAD, ROW_PER_PROGRAM, BLOCK_M, BLOCK_N, BLOCK_D, D)
    if BIAS_GRAD:  # the segments the last query tile began
        last = lo + tl.maximum(tl.cdiv(hi - lo, BLOCK_M) - 1, 0) * BLOCK_M
        base = offset + last - n_start + tl.arange(0, BLOCK_M)
        _add_segment(grad_row, base - (BLOCK_N - BLOCK_M), carry_bias[0], N, ROW_PER_PROGRAM)
        if BLOCK_N != BLOCK_M:
            _add_segment(grad_row, base, carry_bias[1], N, ROW_PER_PROGRAM)
        if HAS_WEIGHT:
            _add_segment(grad_weight_row, base - (BLOCK_N - BLOCK_M), carry_weight[0], N, ROW_PER_PROGRAM)
            if BLOCK_N != BLOCK_M:
                _add_segment(grad_weight_row, base, carry_weight[1], N, ROW_PER_PROGRAM)
    if HAS_WEIGHT:
        grad_k = grad_k * (1.0 / LOG2E)
    grad_start = bh.to(tl.int64) * S * D
    _store_tile(DK + grad_start, n_start, D, S, grad_k, BLOCK_N, BLOCK_D, D)
    _store_tile(DV + grad_start, n_start, D, S, grad_v * keep_scale, BLOCK_N, BLOCK_D, D)
    if HAS_GATES:
        tl.store(DGateK + bh.to(tl.int64) * S + s, grad_key_gates, mask=s < S)
