"""Plain-loop float64 references of the attention rules after FoX, one query and one key at a time:
stick-breaking attention, scalable softmax (and Llama 4's query temperature), selective attention and
ReRoPE. Each follows the reference implementation named in its docstring. Inputs are torch float64
tensors and every value is built from 0-d tensors, so autograd gives the references' gradients;
logits ``z`` are ``[T, T]`` (query, key) already scaled by ``1/sqrt(D)``, positions 0-based."""

import math

import torch

NEG_INF = float("-inf")


def stack(rows):
    """``[len(rows), len(rows[0])]`` from a list of lists of 0-d tensors."""
    return torch.stack([torch.stack(row) for row in rows])


def stick_breaking(z, v=None, attend_current=False):
    """Stick-breaking attention of one head (Tan et al., ICLR 2025; shawntan/stickbreaking-attention,
    ``sb_attn`` and its reference): ``b_ij = sigmoid(z_ij)``, ``A_ij = b_ij prod_{j<k<i} (1 - b_ik)``
    over keys ``j < i`` (``attend_current``: ``j <= i``, the product then running to ``k = i``), and
    the remainder ``r_i = prod_k (1 - b_ik)`` over the same keys. Returns ``(A [T, T], r [T])`` and,
    with values ``v``, the output ``o_i = sum_j A_ij v_j + r_i v_i`` (the reference's tests)."""
    length = z.shape[0]
    zero = z.new_zeros(())
    rows, rests = [], []
    for i in range(length):
        row = [zero] * length
        rest = z.new_ones(())
        last = i if attend_current else i - 1
        for j in range(last, -1, -1):  # from the most recent key backwards
            b = torch.sigmoid(z[i, j])
            row[j] = b * rest
            rest = rest * (1 - b)
        rows.append(row)
        rests.append(rest)
    weights, rest = stack(rows), torch.stack(rests)
    if v is None:
        return weights, rest
    return weights, rest, weights @ v + rest[:, None] * v


def log_space_stick_breaking(z, attend_current=False):
    """The same weights as the reference computes them: ``log A_ij = logsigmoid(z_ij) + sum_{j<k<i}
    logsigmoid(-z_ik)``."""
    length = z.shape[0]
    rows = []
    for i in range(length):
        last = i if attend_current else i - 1
        row = []
        for j in range(length):
            if j > last:
                row.append(z.new_zeros(()))
                continue
            log_a = -torch.log1p(torch.exp(-z[i, j]))
            for k in range(j + 1, last + 1):
                log_a = log_a - torch.log1p(torch.exp(z[i, k]))
            row.append(torch.exp(log_a))
        rows.append(row)
    return stack(rows)


def causal_softmax(logits):
    """Row-wise softmax over keys ``j <= i``; ``[T, T]``, 0 above the diagonal."""
    length = logits.shape[0]
    rows = []
    for i in range(length):
        top = max(logits[i, j].item() for j in range(i + 1))
        e = [torch.exp(logits[i, j] - top) for j in range(i + 1)]
        total = sum(e)
        rows.append([x / total for x in e] + [logits.new_zeros(())] * (length - i - 1))
    return stack(rows)


def ssmax_logits(z, s, first_position=0, window=0):
    """Scalable softmax (Nakanishi, 2025): query ``i``'s logits times ``s * log(n_i)``, ``n_i`` the
    number of keys it attends to (itself included: ``i + 1``, at most ``window``), ``s`` the head's
    learned scale; ``-inf`` where it does not attend."""
    length = z.shape[0]
    rows = []
    for i in range(length):
        n = first_position + i + 1
        n = min(n, window) if window else n
        rows.append([z[i, j] * s * math.log(n) if j <= i and (not window or i - j < window)
                     else z.new_tensor(NEG_INF) for j in range(length)])
    return stack(rows)


def bam_prior(shape, log_scale, loc, length, window=0):
    """BAM's prior of one head by loops (Bianchessi et al., ICLR 2026; its code's ``AttentionPrior``):
    ``-e^s (|(j - i) - 2 sinh(l)| + 1e-5)^beta`` for the keys query ``i`` attends to, ``-inf`` elsewhere;
    ``shape``, ``log_scale`` and ``loc`` 0-dimensional float64 tensors."""
    rows = []
    for i in range(length):
        rows.append([-torch.exp(log_scale) * (torch.abs((j - i) - 2 * torch.sinh(loc)) + 1e-5) ** shape
                     if j <= i and (not window or i - j < window) else loc.new_tensor(NEG_INF)
                     for j in range(length)])
    return stack(rows)


def path_inputs(x, first, second, conv, beta_weight, beta_bias, heads):
    """PaTH's ``w`` ``[H, T, D]`` and ``beta`` ``[H, T]`` from one sequence's layer input ``x`` ``[T, E]``, token
    by token (flash-linear-attention's ``PaTHAttention``): ``u_t = second @ (first @ x_t)``; channel ``c`` of
    ``silu(sum_m conv[c, 0, m] u_{t - 2 + m}[c])`` (``u`` 0 before the first token), the head's slice
    normalised to unit length; ``beta_t = 2 sigmoid(beta_weight @ x_t + beta_bias)``."""
    length = x.shape[0]
    projected = [second @ (first @ x[t]) for t in range(length)]
    width = conv.shape[-1]
    ws, betas = [], []
    for t in range(length):
        mixed = sum(conv[:, 0, m] * projected[t - width + 1 + m] for m in range(width) if t - width + 1 + m >= 0)
        w = torch.nn.functional.silu(mixed).view(heads, -1)
        ws.append(w / w.norm(dim=-1, keepdim=True))
        betas.append(2 * torch.sigmoid(beta_weight @ x[t] + beta_bias))
    return torch.stack(ws, dim=1), torch.stack(betas, dim=1)


def path_logits(q, k, w, beta, window=0):
    """PaTH (Yang et al., NeurIPS 2025) for one head: ``q_i^T H_i H_{i-1} ... H_{j+1} k_j / sqrt(D)`` with the
    matrices ``H_s = I - beta_s w_s w_s^T`` multiplied out; ``-inf`` where query ``i`` does not attend."""
    length, dim = q.shape
    eye = torch.eye(dim, dtype=q.dtype)
    householder = [eye - beta[s] * torch.outer(w[s], w[s]) for s in range(length)]
    rows = []
    for i in range(length):
        row = []
        for j in range(length):
            if j > i or (window and i - j >= window):
                row.append(q.new_tensor(NEG_INF))
                continue
            product = eye
            for s in range(j + 1, i + 1):
                product = householder[s] @ product
            row.append(q[i] @ product @ k[j] / math.sqrt(dim))
        rows.append(row)
    return stack(rows)


def llama4_query_temperature(position, beta=0.1, floor_scale=8192):
    """Llama 4's inference-time factor on the query at 0-based ``position`` (transformers'
    ``modeling_llama4``: ``log1p(floor((position + 1) / floor_scale)) * attn_scale + 1``): 1 below
    ``floor_scale - 1``."""
    return 1.0 + beta * math.log(math.floor((position + 1) / floor_scale) + 1)


def swan_query_scale(position, base=362.0):
    """SWAN-GPT's inference-time factor on the query at 0-based ``position`` in its global NoPE layers:
    ``log_a(position + a)`` (HypeNet, 2026, Eq. 11, restating Puvvada et al. 2025; Tencent-Hunyuan/HiLS-Attention's
    reimplementation, ``a = 362``): 1 at the first token."""
    return math.log(position + base) / math.log(base)


def selective_logits(z):
    """Selective attention (Leviathan et al., ICLR 2025; x-transformers' ``selective_attn``): from
    head 0's causal logits, ``S_kj = relu(z0_kj)`` for ``0 < j < k``, 0 on the diagonal and for the
    first token (``j = 0``); ``F_ij = sum_{k<i} S_kj``, subtracted from every head's logits (``-inf``
    above the diagonal). ``z``: ``[H, T, T]``."""
    heads, length, _ = z.shape
    zero = z.new_zeros(())
    selection = [[torch.relu(z[0, k, j]) if 0 < j < k else zero for j in range(length)] for k in range(length)]
    out = []
    for h in range(heads):
        rows = []
        for i in range(length):
            row = []
            for j in range(length):
                if j > i:
                    row.append(z.new_tensor(NEG_INF))
                    continue
                forgotten = zero
                for k in range(i):
                    forgotten = forgotten + selection[k][j]
                row.append(z[h, i, j] - forgotten)
            rows.append(row)
        out.append(stack(rows))
    return torch.stack(out)


def rotary_logit(q, k, distance, theta):
    """RoFormer's ``(R_i q)^T (R_j k) / sqrt(D)`` for ``i - j = distance``: pair ``p`` (the two halves,
    as the plugin pairs them) is ``Re[(q_p + i q_p') conj(k_p + i k_p') e^(i distance theta_p)]``."""
    half = q.shape[0] // 2
    total = q.new_zeros(())
    for p in range(half):
        angle = distance * theta[p]
        q1, q2, k1, k2 = q[p], q[p + half], k[p], k[p + half]
        total = total + (q1 * k1 + q2 * k2) * math.cos(angle) + (q1 * k2 - q2 * k1) * math.sin(angle)
    return total / math.sqrt(q.shape[0])


def rerope_logits(q, k, window, leak=None, base=10000.0, train_length=None):
    """ReRoPE (Su, 2023; bojone/rerope): rotary logits with the relative position ``d = i - j`` kept
    below ``window`` and set to ``window`` from it on; leaky (``leak = k``): ``window + (d - window) / k``;
    with ``train_length`` L, the query at ``i`` times ``max(1, log(i + 1) / log L)``, as the reference's
    patches scale it. ``q``, ``k``: ``[T, D]`` of one head, unrotated; ``-inf`` above the diagonal."""
    length, dim = q.shape
    theta = [base ** (-2.0 * p / dim) for p in range(dim // 2)]
    rows = []
    for i in range(length):
        row = []
        for j in range(length):
            if j > i:
                row.append(q.new_tensor(NEG_INF))
                continue
            d = i - j
            if d >= window:
                d = window if leak is None else window + (d - window) / leak
            scale = 1.0 if train_length is None else max(1.0, math.log(i + 1) / math.log(train_length))
            row.append(rotary_logit(q[i] * scale, k[j], d, theta))
        rows.append(row)
    return stack(rows)
