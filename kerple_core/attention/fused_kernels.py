"""The Triton kernels of the fused distance-bias attention (:mod:`kerple_core.attention.fused`).

FlashAttention-2's tiling (Dao, "FlashAttention-2", 2023, §3): one program per tile of ``BLOCK_M`` queries
of one head runs over the key tiles its queries see with an online softmax; the backward recomputes the
probabilities from the saved log-sum-exp, one program per key tile for ``dK``, ``dV`` and the gates'
column sums, one per query tile for ``dQ``, the gates' row sums and the per-distance gradients (each tile's logit
gradients sheared so that its diagonals become columns, summed, and added with one atomic add per
distance, into a row of the program's own, summed in a fixed order after the kernel, or of its head's).

The logit of query ``t`` and key ``s`` (``d = offset + t - s`` positions apart) is

    ``x_ts = (q_t . k_s) * W(d) + B(d) + c[offset + t] - c[s]``

with ``B`` and ``W`` read from float32 tables ``[heads, distances]`` (``W`` only for a weight kernel) and
``c`` a per-key float32 state (the Forgetting Transformer's cumulative log forget gates), all in float32;
``-inf`` where ``d < 0``, ``d >= window`` (a window of ``window`` keys, 0: none) or ``s`` is padding. Key
tiles wholly in the future or wholly outside the window are never visited. Dropout keeps a cell where
``tl.rand(seed + batch * heads + head, t * S + s) >= p`` (Philox, counter-based), so the backward
regenerates the forward's mask and no mask is stored.
"""

import triton
import triton.language as tl


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
def _logits(q, k, bias_ptr, weight_ptr, gates_ptr, padding_ptr, b, h, t, s, T, S, N, offset, window,
            HAS_WEIGHT: tl.constexpr, HAS_GATES: tl.constexpr, HAS_PADDING: tl.constexpr,
            IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """The float32 logits ``[BLOCK_M, BLOCK_N]`` of queries ``t`` and keys ``s``, ``-inf`` where unseen, and
    the scores ``q . k`` (a weight kernel's gradient reads them)."""
    scores = _dot(q, tl.trans(k), IEEE, UPCAST)
    d = offset + t[:, None] - s[None, :]
    seen = (d >= 0) & (t[:, None] < T) & (s[None, :] < S) & (d < N)
    if window > 0:
        seen = seen & (d < window)
    index = h * N + tl.where(seen, d, 0)
    logits = scores
    if HAS_WEIGHT:
        logits = logits * tl.load(weight_ptr + index, mask=seen, other=0.0)
    logits = logits + tl.load(bias_ptr + index, mask=seen, other=0.0)
    if HAS_GATES:
        c_query = tl.load(gates_ptr + offset + t, mask=t < T, other=0.0)
        c_key = tl.load(gates_ptr + s, mask=s < S, other=0.0)
        logits = logits + c_query[:, None] - c_key[None, :]
    if HAS_PADDING:
        padded = tl.load(padding_ptr + b * S + s, mask=s < S, other=1)
        seen = seen & (padded[None, :] == 0)
    return tl.where(seen, logits, float("-inf")), scores, seen, d


@triton.jit
def _rows(X, b, h, stride_b, stride_h, stride_row, rows, num_rows, j, D):
    """The ``[len(rows), BLOCK_D]`` rows ``rows`` of head ``h`` of batch element ``b`` of ``X`` (``[B, H, R, D]``,
    its last dimension contiguous), 0 past ``num_rows`` rows and ``D`` dimensions."""
    return tl.load(X + b * stride_b + h * stride_h + rows[:, None] * stride_row + j[None, :],
                   mask=(rows[:, None] < num_rows) & (j[None, :] < D), other=0.0)


@triton.jit
def _kept(seed, bh, t, s, S, p):
    """Dropout's keep mask of cells ``(t, s)`` of head ``bh`` (batch * heads + head)."""
    return tl.rand(seed + bh, t[:, None] * S + s[None, :]) >= p


@triton.jit
def keep_mask_kernel(Out, seed, S, T, p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Writes the keep mask of one head (a test regenerates the forward's dropout with it)."""
    m = tl.program_id(0)
    n = tl.program_id(1)
    bh = tl.program_id(2)
    t = m * BLOCK_M + tl.arange(0, BLOCK_M)
    s = n * BLOCK_N + tl.arange(0, BLOCK_N)
    keep = _kept(seed, bh, t, s, S, p)
    tl.store(Out + bh * T * S + t[:, None] * S + s[None, :], keep.to(tl.int8),
             mask=(t[:, None] < T) & (s[None, :] < S))


@triton.jit
def _key_range(first_query, last_query, offset, window, S, BLOCK_N: tl.constexpr):
    """Key tiles ``[lo, hi)`` (in keys, ``lo`` a tile boundary) seen by queries ``first_query .. last_query``."""
    hi = tl.minimum(S, offset + last_query + 1)
    lo = 0
    if window > 0:
        lo = tl.maximum(0, offset + first_query - window + 1)
        lo = (lo // BLOCK_N) * BLOCK_N
    return lo, hi


@triton.jit
def forward_kernel(Q, K, V, Out, LSE, Bias, Weight, Gates, Padding, seed, p,
                   sqb, sqh, sqt, skb, skh, sks, svb, svh, svs, sob, soh, sot,
                   H, T, S, N, offset, window,
                   HAS_WEIGHT: tl.constexpr, HAS_GATES: tl.constexpr, HAS_PADDING: tl.constexpr,
                   HAS_DROPOUT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr):
    m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    t = m * BLOCK_M + tl.arange(0, BLOCK_M)
    j = tl.arange(0, BLOCK_D)
    dims = j < D
    q = _rows(Q, b, h, sqb, sqh, sqt, t, T, j, D)
    gates = Gates + bh * S
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, hi = _key_range(m * BLOCK_M, tl.minimum(m * BLOCK_M + BLOCK_M, T) - 1, offset, window, S, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        s = start + tl.arange(0, BLOCK_N)
        k = _rows(K, b, h, skb, skh, sks, s, S, j, D)
        v = _rows(V, b, h, svb, svh, svs, s, S, j, D)
        logits, _, _, _ = _logits(q, k, Bias, Weight, gates, Padding, b, h, t, s, T, S, N, offset, window,
                                  HAS_WEIGHT, HAS_GATES, HAS_PADDING, IEEE, UPCAST)
        new_max = tl.maximum(row_max, tl.max(logits, 1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        scale = tl.exp(row_max - safe_max)
        probabilities = tl.exp(logits - safe_max[:, None])
        row_sum = row_sum * scale + tl.sum(probabilities, 1)
        if HAS_DROPOUT:
            probabilities = tl.where(_kept(seed, bh, t, s, S, p), probabilities / (1.0 - p), 0.0)
        acc = acc * scale[:, None] + _dot(probabilities.to(v.dtype), v, IEEE, UPCAST)
        row_max = new_max
    seen_any = row_sum > 0
    out = acc / tl.where(seen_any, row_sum, 1.0)[:, None]
    # a row that sees no key attends to nothing: its log-sum-exp is +inf, so its recomputed probabilities are 0
    lse = tl.where(seen_any, row_max + tl.log(tl.where(seen_any, row_sum, 1.0)), float("inf"))
    tl.store(Out + b * sob + h * soh + t[:, None] * sot + j[None, :], out.to(Out.dtype.element_ty),
             mask=(t[:, None] < T) & dims[None, :])
    tl.store(LSE + bh * T + t, lse, mask=t < T)


@triton.jit
def _probabilities_and_grad(q, k, v, do, lse, delta, Bias, Weight, gates, Padding, seed, p, b, h, bh, t, s,
                            T, S, N, offset, window, HAS_WEIGHT: tl.constexpr, HAS_GATES: tl.constexpr,
                            HAS_PADDING: tl.constexpr, HAS_DROPOUT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """A tile's probabilities as attended (dropped and rescaled), the logits' gradient, the scores, which
    cells are seen and their distances."""
    logits, scores, seen, d = _logits(q, k, Bias, Weight, gates, Padding, b, h, t, s, T, S, N, offset, window,
                                      HAS_WEIGHT, HAS_GATES, HAS_PADDING, IEEE, UPCAST)
    probabilities = tl.exp(logits - lse[:, None])
    grad_attended = _dot(do, tl.trans(v), IEEE, UPCAST)
    attended = probabilities
    if HAS_DROPOUT:
        kept = _kept(seed, bh, t, s, S, p)
        attended = tl.where(kept, probabilities / (1.0 - p), 0.0)
        grad_attended = tl.where(kept, grad_attended / (1.0 - p), 0.0)
    grad_logits = probabilities * (grad_attended - delta[:, None])
    return attended, grad_logits, scores, seen, d


@triton.jit
def backward_keys_kernel(Q, K, V, DO, LSE, Delta, DK, DV, DGateKeys, Bias, Weight, Gates, Padding, seed, p,
                         sqb, sqh, sqt, skb, skh, sks, svb, svh, svs, sdb, sdh, sdt,
                         H, T, S, N, offset, window,
                         HAS_WEIGHT: tl.constexpr, HAS_GATES: tl.constexpr, HAS_PADDING: tl.constexpr,
                         HAS_DROPOUT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr):
    n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    s = n * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.arange(0, BLOCK_D)
    dims = j < D
    key_mask = (s[:, None] < S) & dims[None, :]
    k = _rows(K, b, h, skb, skh, sks, s, S, j, D)
    v = _rows(V, b, h, svb, svh, svs, s, S, j, D)
    gates = Gates + bh * S
    grad_k = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    grad_v = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    grad_key_gates = tl.zeros([BLOCK_N], tl.float32)
    # queries that see these keys: from the first at or after the tile's first key, to the last whose window
    # still holds the tile's last key
    first = tl.maximum(0, n * BLOCK_N - offset)
    last = T
    if window > 0:
        last = tl.minimum(T, n * BLOCK_N + BLOCK_N - 1 + window - offset)
    for start in range((first // BLOCK_M) * BLOCK_M, last, BLOCK_M):
        t = start + tl.arange(0, BLOCK_M)
        q = _rows(Q, b, h, sqb, sqh, sqt, t, T, j, D)
        do = _rows(DO, b, h, sdb, sdh, sdt, t, T, j, D)
        lse = tl.load(LSE + bh * T + t, mask=t < T, other=float("inf"))
        delta = tl.load(Delta + bh * T + t, mask=t < T, other=0.0)
        attended, grad_logits, scores, seen, d = _probabilities_and_grad(
            q, k, v, do, lse, delta, Bias, Weight, gates, Padding, seed, p, b, h, bh, t, s, T, S, N, offset, window,
            HAS_WEIGHT, HAS_GATES, HAS_PADDING, HAS_DROPOUT, IEEE, UPCAST)
        grad_scores = grad_logits
        if HAS_WEIGHT:
            grad_scores = grad_logits * tl.load(Weight + h * N + tl.where(seen, d, 0), mask=seen, other=0.0)
        grad_v += _dot(tl.trans(attended.to(do.dtype)), do, IEEE, UPCAST)
        grad_k += _dot(tl.trans(grad_scores.to(q.dtype)), q, IEEE, UPCAST)
        if HAS_GATES:
            grad_key_gates -= tl.sum(grad_logits, 0)
    tl.store(DK + bh * S * D + s[:, None] * D + j[None, :], grad_k.to(DK.dtype.element_ty), mask=key_mask)
    tl.store(DV + bh * S * D + s[:, None] * D + j[None, :], grad_v.to(DV.dtype.element_ty), mask=key_mask)
    if HAS_GATES:
        tl.store(DGateKeys + bh * S + s, grad_key_gates, mask=s < S)


@triton.jit
def _diagonal_sums(x, column, on_tile):
    """``[BLOCK_M + BLOCK_N]``: the sums of ``x`` ``[BLOCK_M, BLOCK_N]`` along its diagonals, sheared into columns."""
    return tl.sum(tl.where(on_tile, tl.gather(x, column, 1), 0.0), 0)


@triton.jit
def backward_queries_kernel(Q, K, V, DO, LSE, Delta, DQ, DGateQueries, DBias, DWeight, sgb, sgh, sgm,
                            Bias, Weight, Gates, Padding, seed, p,
                            sqb, sqh, sqt, skb, skh, sks, svb, svh, svs, sdb, sdh, sdt,
                            H, T, S, N, offset, window,
                            HAS_WEIGHT: tl.constexpr, HAS_GATES: tl.constexpr, HAS_PADDING: tl.constexpr,
                            HAS_DROPOUT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, BIAS_GRAD: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr):
    m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    t = m * BLOCK_M + tl.arange(0, BLOCK_M)
    j = tl.arange(0, BLOCK_D)
    dims = j < D
    rows = (t[:, None] < T) & dims[None, :]
    q = _rows(Q, b, h, sqb, sqh, sqt, t, T, j, D)
    do = _rows(DO, b, h, sdb, sdh, sdt, t, T, j, D)
    lse = tl.load(LSE + bh * T + t, mask=t < T, other=float("inf"))
    delta = tl.load(Delta + bh * T + t, mask=t < T, other=0.0)
    gates = Gates + bh * S
    grad_q = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    grad_query_gates = tl.zeros([BLOCK_M], tl.float32)
    # cell (i, column[i, c]) of a tile lies on its diagonal c (i - j = c - (BLOCK_N - 1)); square tiles of a power
    # of two have 2 BLOCK_M - 1 diagonals, one fewer than the power of two tl.arange needs
    tl.static_assert(BLOCK_M == BLOCK_N)
    diagonal = tl.arange(0, BLOCK_M + BLOCK_N)
    column = tl.arange(0, BLOCK_M)[:, None] - diagonal[None, :] + BLOCK_N - 1
    on_tile = (column >= 0) & (column < BLOCK_N)
    column = tl.where(on_tile, column, 0)
    lo, hi = _key_range(m * BLOCK_M, tl.minimum(m * BLOCK_M + BLOCK_M, T) - 1, offset, window, S, BLOCK_N)
    # this program's row of the per-distance gradients: its own (deterministic sums) or its head's (atomic)
    grad_row = (b * sgb + h * sgh + m * sgm) * N
    for start in range(lo, hi, BLOCK_N):
        s = start + tl.arange(0, BLOCK_N)
        k = _rows(K, b, h, skb, skh, sks, s, S, j, D)
        v = _rows(V, b, h, svb, svh, svs, s, S, j, D)
        attended, grad_logits, scores, seen, d = _probabilities_and_grad(
            q, k, v, do, lse, delta, Bias, Weight, gates, Padding, seed, p, b, h, bh, t, s, T, S, N, offset, window,
            HAS_WEIGHT, HAS_GATES, HAS_PADDING, HAS_DROPOUT, IEEE, UPCAST)
        grad_scores = grad_logits
        if HAS_WEIGHT:
            grad_scores = grad_logits * tl.load(Weight + h * N + tl.where(seen, d, 0), mask=seen, other=0.0)
        if BIAS_GRAD:
            # the tile's diagonals summed, one atomic add per distance: d = offset + t0 - s0 + c - (BLOCK_N - 1)
            distances = offset + m * BLOCK_M - start + diagonal - (BLOCK_N - 1)
            adds = (diagonal < BLOCK_M + BLOCK_N - 1) & (distances >= 0) & (distances < N)
            tl.atomic_add(DBias + grad_row + distances, _diagonal_sums(tl.where(seen, grad_logits, 0.0), column, on_tile),
                          mask=adds)
            if HAS_WEIGHT:
                tl.atomic_add(DWeight + grad_row + distances,
                              _diagonal_sums(tl.where(seen, grad_logits * scores, 0.0), column, on_tile), mask=adds)
        grad_q += _dot(grad_scores.to(k.dtype), k, IEEE, UPCAST)
        if HAS_GATES:
            grad_query_gates += tl.sum(grad_logits, 1)
    tl.store(DQ + bh * T * D + t[:, None] * D + j[None, :], grad_q.to(DQ.dtype.element_ty), mask=rows)
    if HAS_GATES:
        tl.store(DGateQueries + bh * T + t, grad_query_gates, mask=t < T)
