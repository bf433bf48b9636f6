"""Plain-loop float64 references of the attention rules after FoX, one query and one key at a time:
stick-breaking attention, scalable softmax (and Llama 4's query temperature), selective attention and
ReRoPE. Each follows the reference implementation named in its docstring; arrays are NumPy float64,
logits ``z`` are ``[T, T]`` (query, key) already scaled by ``1/sqrt(D)``, positions 0-based."""

import math

import numpy as np


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def stick_breaking(z, v, attend_current=False, remainder="current_value", head_bias=None):
    """Stick-breaking attention of one head (Tan et al., ICLR 2025; shawntan/stickbreaking-attention,
    ``sb_attn`` and its ``sb_ref``): ``b_ij = sigmoid(z_ij)``, ``A_ij = b_ij prod_{j<k<i} (1 - b_ik)``
    over keys ``j < i`` (``attend_current``: ``j <= i``, the product then running to ``k = i``), and
    the remainder ``r_i = prod_k (1 - b_ik)`` over the same keys, equal to ``1 - sum_j A_ij``.
    The output ``o_i = sum_j A_ij v_j`` plus ``r_i v_i`` (``remainder="current_value"``, the
    reference's tests), ``r_i * head_bias`` (``"head_bias"``, the authors' later models) or nothing
    (``"none"``, flash-linear-attention's layer). Returns ``(A [T, T], r [T], o [T, D])``."""
    length = z.shape[0]
    weights = np.zeros((length, length))
    rest = np.ones(length)
    for i in range(length):
        last = i if attend_current else i - 1
        for j in range(last, -1, -1):  # from the most recent key backwards
            b = sigmoid(z[i, j])
            weights[i, j] = b * rest[i]
            rest[i] *= 1.0 - b
    out = weights @ v
    if remainder == "current_value":
        out = out + rest[:, None] * v
    elif remainder == "head_bias":
        out = out + rest[:, None] * np.asarray(head_bias)[None, :]
    elif remainder != "none":
        raise ValueError(remainder)
    return weights, rest, out


def log_space_stick_breaking(z, attend_current=False):
    """The same weights as the reference computes them: ``log A_ij = logsigmoid(z_ij) + sum_{j<k<i}
    logsigmoid(-z_ik)``."""
    length = z.shape[0]
    weights = np.zeros((length, length))
    for i in range(length):
        last = i if attend_current else i - 1
        for j in range(last + 1):
            log_a = -math.log1p(math.exp(-z[i, j]))
            log_a += sum(-math.log1p(math.exp(z[i, k])) for k in range(j + 1, last + 1))
            weights[i, j] = math.exp(log_a)
    return weights


def causal_softmax(logits):
    """Row-wise softmax over keys ``j <= i``; ``[T, T]``."""
    length = logits.shape[0]
    probabilities = np.zeros_like(logits)
    for i in range(length):
        row = logits[i, : i + 1]
        e = np.exp(row - row.max())
        probabilities[i, : i + 1] = e / e.sum()
    return probabilities


def ssmax_logits(z, s, first_position=0):
    """Scalable softmax (Nakanishi, 2025): query ``i``'s logits times ``s * log(n_i)``, ``n_i = i + 1``
    the number of keys it attends to (itself included), ``s`` the head's learned scale."""
    out = np.full_like(z, -np.inf)
    for i in range(z.shape[0]):
        n = first_position + i + 1
        for j in range(i + 1):
            out[i, j] = z[i, j] * s * math.log(n)
    return out


def llama4_query_temperature(position, beta=0.1, floor_scale=8192):
    """Llama 4's inference-time factor on the query at 0-based ``position`` (transformers'
    ``modeling_llama4``: ``log1p(floor((position + 1) / floor_scale)) * attn_scale + 1``): 1 below
    ``floor_scale - 1``."""
    return 1.0 + beta * math.log(math.floor((position + 1) / floor_scale) + 1)


def selective_logits(z):
    """Selective attention (Leviathan et al., ICLR 2025; x-transformers' ``selective``): from head 0's
    causal logits, ``S_kj = relu(z0_kj)`` for ``j < k``, 0 on the diagonal and for the first token
    (``j = 0``); ``F_ij = sum_{k<i} S_kj``, subtracted from every head's logits. ``z``: ``[H, T, T]``."""
    heads, length, _ = z.shape
    selection = np.zeros((length, length))
    for k in range(length):
        for j in range(1, k):
            selection[k, j] = max(z[0, k, j], 0.0)
    out = np.full_like(z, -np.inf)
    for h in range(heads):
        for i in range(length):
            for j in range(i + 1):
                forgotten = sum(selection[k, j] for k in range(i))
                out[h, i, j] = z[h, i, j] - forgotten
    return out


def rotary_logit(q, k, distance, theta):
    """``q . k`` after rotating ``q`` by ``distance`` relative to ``k`` (pairs are the two halves,
    as the plugin's rotary embedding), divided by ``sqrt(D)``."""
    half = q.shape[0] // 2
    total = 0.0
    for p in range(half):
        angle = distance * theta[p]
        q1, q2, k1, k2 = q[p], q[p + half], k[p], k[p + half]
        total += (q1 * k1 + q2 * k2) * math.cos(angle) + (q2 * k1 - q1 * k2) * math.sin(angle)
    return total / math.sqrt(q.shape[0])


def rerope_logits(q, k, window, leak=None, base=10000.0):
    """ReRoPE (Su, 2023; bojone/rerope): rotary logits with the relative position ``d = i - j`` kept
    below ``window`` and set to ``window`` from it on; leaky (``leak = k``): ``window + (d - window) / k``.
    ``q``, ``k``: ``[T, D]`` of one head, unrotated."""
    length, dim = q.shape
    theta = [base ** (-2.0 * p / dim) for p in range(dim // 2)]
    out = np.full((length, length), -np.inf)
    for i in range(length):
        for j in range(i + 1):
            d = i - j
            if d >= window:
                d = window if leak is None else window + (d - window) / leak
            out[i, j] = rotary_logit(q[i], k[j], d, theta)
    return out
