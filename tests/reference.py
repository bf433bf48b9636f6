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


def matrix(num_heads, length, fn, future=-np.inf):
    """[H, L, L] with fn(h, d) for j <= i and `future` above the diagonal, one entry at a time
    (fn evaluated once per head and distance)."""
    values = {}
    out = np.full((num_heads, length, length), future, dtype=np.float64)
    for h in range(num_heads):
        for i in range(length):
            for j in range(i + 1):
                if (h, i - j) not in values:
                    values[h, i - j] = fn(h, i - j)
                out[h, i, j] = values[h, i - j]
    return out


def bias_matrix(num_heads, length, fn):
    return matrix(num_heads, length, fn)


def weight_matrix(num_heads, length, fn):
    """Weights below and on the diagonal; 0 for future keys (they are masked anyway)."""
    return matrix(num_heads, length, fn, future=0.0)


def power(d, p):
    return d ** p if d > 0 else 0.0


def windowed(fn, window):
    return lambda h, d: fn(h, d) if d < window else -math.inf


def alibi(slopes):
    return lambda h, d: -slopes[h] * d


def alibi_rf(slopes, rho, decay):
    def fade(h, d):
        if decay == "exponential":
            return math.exp(-d / rho[h])
        if decay == "gaussian":
            return math.exp(-(d * d) / (2.0 * rho[h] ** 2))
        return rho[h] / (rho[h] + d)

    return lambda h, d: -slopes[h] * d * fade(h, d)


def kerple_log(r1, r2):
    return lambda h, d: -r1[h] * math.log(1.0 + r2[h] * d)


def kerple_power(r1, r2):
    return lambda h, d: -r1[h] * power(d, r2[h])


def kerple_log3(r1, r2, r3):
    return lambda h, d: -r1[h] * math.log(1.0 + r2[h] * power(d, r3[h]))


def gauss_bias(r1, r2, r3):
    return lambda h, d: r1[h] * math.exp(-r2[h] * power(d, r3[h]))


def gauss_weight(r1, r2):
    return lambda h, d: math.exp(-r1[h] * power(d, r2[h]))


def t5_bucket(d, num_buckets=32, max_distance=128):
    """Raffel et al.'s causal bucket: exact below num_buckets/2, then logarithmic to max_distance."""
    exact = num_buckets // 2
    if d < exact:
        return d
    return min(num_buckets - 1, exact + int(math.floor(math.log(d / exact) / math.log(max_distance / exact)
                                                       * (num_buckets - exact))))


def t5(table):
    return lambda h, d: table[h][t5_bucket(d)]


def sandwich_value(d, dim):
    return sum(math.cos(d / 10000.0 ** (2.0 * k / dim)) for k in range(dim // 2)) - dim / 2.0


def sandwich(num_heads, dim):
    return lambda h, d: sandwich_value(d, dim) / (8.0 * (h + 1) / num_heads)


def sandwich_fit(num_heads, dim, points):
    """numpy least squares of y = -a log(1 + d) + b to each head's Sandwich curve at d = 0..points-1."""
    curve = sandwich(num_heads, dim)
    d = np.arange(points, dtype=np.float64)
    design = np.stack([-np.log1p(d), np.ones(points)], axis=1)
    fits = []
    for h in range(num_heads):
        y = np.array([curve(h, x) for x in range(points)])
        fits.append(np.linalg.lstsq(design, y, rcond=None)[0])
    return fits


def sandwich_smoothed(num_heads, dim, points):
    fits = sandwich_fit(num_heads, dim, points)
    return lambda h, d: -fits[h][0] * math.log(1.0 + d) + fits[h][1]


def no_bias():
    return lambda h, d: 0.0
