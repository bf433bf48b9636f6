"""Independent float64 implementations of SPEC's kernel formulas, written as plain loops."""

import math

import numpy as np


def alibi_slopes_reference(num_heads):
    """SPEC: H a power of 2: m_h = 2^(-8h/H); otherwise n = 2^floor(log2 H): slopes(n)
    followed by every other slope of slopes(2n), the first H - n of them."""
    n = 1
    while n * 2 <= num_heads:
        n *= 2
    slopes = [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]
    twice = [2.0 ** (-8.0 * h / (2 * n)) for h in range(1, 2 * n + 1)]
    extra = []
    for index, slope in enumerate(twice):
        if index % 2 == 0 and len(extra) < num_heads - n:
            extra.append(slope)
    return slopes + extra


def bias_matrix(num_heads, length, fn):
    """[H, L, L] with fn(h, d) for j <= i and -inf above the diagonal, one entry at a time."""
    out = np.full((num_heads, length, length), -np.inf, dtype=np.float64)
    for h in range(num_heads):
        for i in range(length):
            for j in range(i + 1):
                out[h, i, j] = fn(h, i - j)
    return out


def alibi(slopes):
    return lambda h, d: -slopes[h] * d


def kerple_log(r1, r2):
    return lambda h, d: -r1[h] * math.log(1.0 + r2[h] * d)


def kerple_power(r1, r2):
    return lambda h, d: -r1[h] * (d ** r2[h]) if d > 0 else 0.0


def no_bias():
    return lambda h, d: 0.0
