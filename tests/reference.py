"""Independent float64 implementations of the kernel formulas, written as plain loops.

Nothing here calls the package: the formulas are restated from the papers (ALiBi §3 and Sandwich
eq. 3 for the slopes, KERPLE §4, §5.3 and Appendix A.3, T5 §2.1, Sandwich §6, BAM §2.3) and evaluated one
``(head, distance)`` at a time in Python floats.

:data:`KERNEL_REFERENCES` has one entry per registered kernel: ``entry(kernel, options)`` reads the
built kernel's stored parameters (``r1`` or ``r1_raw``, ``kernel.table``) and its ``num_heads``, and
returns ``(bias, weight)``, two float64 functions of ``(head, distance)`` (``weight`` is ``None`` for
a bias kernel). ``options`` holds the command-line options given to the kernel; options left out take
their documented defaults here, independently of the kernel's own defaults. Adding a kernel means
adding its entry with :func:`reference_for`.
"""

import math

import numpy as np


def alibi_slopes_reference(num_heads):
    """ALiBi (Press et al., §3) and Sandwich eq. 3: H a power of 2: m_h = 2^(-8h/H); otherwise
    n = 2^floor(log2 H): slopes(n) followed by every other slope of slopes(2n), the first H - n of them."""
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


def per_head(num_heads, distances, fn):
    """[H, len(distances)] float64 with fn(h, d) at each head h and each (integer) distance d."""
    out = np.empty((num_heads, len(distances)), dtype=np.float64)
    for h in range(num_heads):
        for index, d in enumerate(distances):
            out[h, index] = fn(h, int(d))
    return out


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


def t5(table, num_buckets=32, max_distance=128, scale=1.0):
    """table[bucket][head], times scale."""
    return lambda h, d: scale * table[t5_bucket(d, num_buckets, max_distance)][h]


def sandwich_value(d, dim):
    return sum(math.cos(d / 10000.0 ** (2.0 * k / dim)) for k in range(dim // 2)) - dim / 2.0


def sandwich(num_heads, dim):
    inner = {}  # the inner product does not depend on the head: one sum per distance

    def bias(h, d):
        if d not in inner:
            inner[d] = sandwich_value(d, dim)
        return inner[d] / (8.0 * (h + 1) / num_heads)

    return bias


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


def bam(shape, log_scale, loc, eps=1e-5):
    """BAM's prior with the query at i, the key at j = i - d: -e^s (|(j - i) - 2 sinh(l)| + eps)^beta."""
    return lambda h, d: -math.exp(log_scale[h]) * (abs(-d - 2.0 * math.sinh(loc[h])) + eps) ** shape[h]


# ---------------------------------------------------------------------------------------------------
# one entry per registered kernel

#: kernel name -> entry(kernel, options) -> (bias(h, d), weight(h, d) or None)
KERNEL_REFERENCES = {}


def reference_for(name):
    """Decorator: the float64 reference of kernel ``name``."""

    def wrap(entry):
        if name in KERNEL_REFERENCES:
            raise ValueError(f"two references for kernel {name!r}")
        KERNEL_REFERENCES[name] = entry
        return entry

    return wrap


def reference_functions(kernel, options=None):
    """``(bias, weight)`` of a built kernel given the options it was built with (``weight`` is None
    for a bias kernel)."""
    if kernel.name not in KERNEL_REFERENCES:
        raise AssertionError(f"no reference for kernel {kernel.name!r}: add one to tests/reference.py")
    return KERNEL_REFERENCES[kernel.name](kernel, dict(options or {}))


def effective_value(stored, parameterization, floor, high):
    """A learnable parameter's value from its stored number: ``clamp`` keeps it in ``[floor, high]``
    (KERPLE's reference code); ``softplus`` maps it to ``floor + log(1 + e^x)``, or to
    ``floor + (high - floor) / (1 + e^-x)`` below a finite ``high``."""
    if parameterization == "clamp":
        return min(max(stored, floor), high)
    if math.isinf(high):
        return floor + (stored + math.log1p(math.exp(-stored)) if stored > 0 else math.log1p(math.exp(stored)))
    return floor + (high - floor) / (1.0 + math.exp(-stored))


def learned(kernel, name):
    """The per-head values of learnable parameter ``name``, as Python floats, from the kernel's stored
    tensor (``name`` under ``clamp``, ``name_raw`` under ``softplus``)."""
    parameterization = kernel.parameterization.name
    stored = getattr(kernel, name if parameterization == "clamp" else name + "_raw").detach().double().tolist()
    return [effective_value(x, parameterization, kernel.floor, kernel.upper_bounds[name]) for x in stored]


def slopes_with_options(num_heads, options):
    """ALiBi's slopes, all equal to 2^-X with ``alibi_equal_slope`` X (Sandwich §4.2), else multiplied
    by 2^-DELTA with ``alibi_shift`` DELTA (Sandwich §4.1, default 0)."""
    equal = options.get("alibi_equal_slope")
    slopes = alibi_slopes_reference(num_heads) if equal is None else [2.0 ** -equal] * num_heads
    return [m * 2.0 ** -options.get("alibi_shift", 0.0) for m in slopes]


@reference_for("alibi")
def alibi_reference(kernel, options):
    """ALiBi §3: B = -m_h * d."""
    return alibi(slopes_with_options(kernel.num_heads, options)), None


@reference_for("alibi_rf")
def alibi_rf_reference(kernel, options):
    """ALiBi with a receptive field: B = -m_h * d * f_rho(d); rho 512 unless given, or learned per head."""
    if options.get("alibi_rf_learnable_rho", False):
        rho = learned(kernel, "rho")
    else:
        rho = [float(options.get("alibi_rf_rho", 512.0))] * kernel.num_heads
    decay = options.get("alibi_rf_decay", "exponential")
    return alibi_rf(slopes_with_options(kernel.num_heads, options), rho, decay), None


@reference_for("none")
def none_reference(kernel, options):
    """NoPE: B = 0 (the causal mask alone)."""
    return no_bias(), None


@reference_for("window")
def window_reference(kernel, options):
    """Windowed attention (Sandwich §4.3): B = 0 inside the window; the window's -inf beyond it is
    applied where the bias is laid out, not by the kernel."""
    return no_bias(), None


@reference_for("kerple_log")
def kerple_log_reference(kernel, options):
    """KERPLE §4, logarithmic variant: B = -r1 * log(1 + r2 * d)."""
    return kerple_log(learned(kernel, "r1"), learned(kernel, "r2")), None


@reference_for("kerple_power")
def kerple_power_reference(kernel, options):
    """KERPLE §4, power variant: B = -r1 * d^r2."""
    return kerple_power(learned(kernel, "r1"), learned(kernel, "r2")), None


@reference_for("kerple_log3")
def kerple_log3_reference(kernel, options):
    """KERPLE §5.3, 3-para-log: B = -r1 * log(1 + r2 * d^r3)."""
    return kerple_log3(learned(kernel, "r1"), learned(kernel, "r2"), learned(kernel, "r3")), None


@reference_for("kerple_bias_wht")
def kerple_bias_wht_reference(kernel, options):
    """KERPLE §5.3, bias+wht: W = exp(-r3 * d^r4), B = -r1 * d^r2."""
    bias = kerple_power(learned(kernel, "r1"), learned(kernel, "r2"))
    return bias, gauss_weight(learned(kernel, "r3"), learned(kernel, "r4"))


@reference_for("gauss_bias2")
def gauss_bias2_reference(kernel, options):
    """KERPLE Appendix A.3, 2-para-bias: B = r1 * exp(-r2 * d^2)."""
    return gauss_bias(learned(kernel, "r1"), learned(kernel, "r2"), [2.0] * kernel.num_heads), None


@reference_for("gauss_bias3")
def gauss_bias3_reference(kernel, options):
    """KERPLE Appendix A.3, 3-para-bias: B = r1 * exp(-r2 * d^r3)."""
    return gauss_bias(learned(kernel, "r1"), learned(kernel, "r2"), learned(kernel, "r3")), None


@reference_for("gauss_wht1")
def gauss_wht1_reference(kernel, options):
    """KERPLE Appendix A.3, 1-para-wht: W = exp(-r1 * d^2), B = 0."""
    return no_bias(), gauss_weight(learned(kernel, "r1"), [2.0] * kernel.num_heads)


@reference_for("gauss_wht2")
def gauss_wht2_reference(kernel, options):
    """KERPLE Appendix A.3, 2-para-wht: W = exp(-r1 * d^r2), B = 0."""
    return no_bias(), gauss_weight(learned(kernel, "r1"), learned(kernel, "r2"))


@reference_for("t5")
def t5_reference(kernel, options):
    """T5 §2.1 (as in KERPLE §4): B = s * b[bucket(d), h], 32 buckets and max distance 128 unless given;
    s = sqrt(head width) unless --t5-bias-scale none (KERPLE's T5 baseline scales the looked-up bias)."""
    table = kernel.table.detach().double().tolist()
    scale = 1.0 if options.get("t5_bias_scale") == "none" else math.sqrt(kernel.head_dim)
    return t5(table, options.get("t5_num_buckets", 32), options.get("t5_max_distance", 128), scale), None


@reference_for("sandwich")
def sandwich_reference(kernel, options):
    """Sandwich §6.1 Eq. 6: B = (sum_k cos(d / 10000^(2k/D)) - D/2) / (8h/H), D = 128 unless given."""
    return sandwich(kernel.num_heads, options.get("sandwich_dim", 128)), None


@reference_for("sandwich_smoothed")
def sandwich_smoothed_reference(kernel, options):
    """Sandwich §6.2: B = -a_h * log(1 + d) + b_h, fitted to head h's Sandwich curve over distances
    0..N-1, D = 128 and N = 50 unless given."""
    dim, points = options.get("sandwich_dim", 128), options.get("sandwich_fit_distances", 50)
    return sandwich_smoothed(kernel.num_heads, dim, points), None


@reference_for("bam")
def bam_reference(kernel, options):
    """BAM (Bianchessi et al., ICLR 2026) §2.3 in its reference code's form, from the stored shape, log-scale
    and location."""
    stored = [getattr(kernel, name).detach().double().tolist() for name in ("shape", "scale", "loc")]
    return bam(*stored), None


def assert_matches(actual, expected, rtol=2e-6, atol=1e-5):
    """A float32 tensor equals float64 reference values: infinities exactly, the rest within tolerance."""
    actual = actual.detach().numpy()
    finite = np.isfinite(expected)
    np.testing.assert_array_equal(np.isfinite(actual), finite)
    np.testing.assert_array_equal(actual[~finite], expected[~finite])
    np.testing.assert_allclose(actual[finite], expected[finite], rtol=rtol, atol=atol)
