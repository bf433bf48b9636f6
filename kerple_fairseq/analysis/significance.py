"""Is a perplexity difference more than noise? A paired bootstrap over the units scored together.

Models evaluated on the same split under the same protocol and length scored the same tokens in the
same spans. The spans are the units: a block of the early-token-cursed or sliding protocol (its
tokens share context, so they are not independent), a target of the last-token protocol. One
bootstrap sample draws ``U`` of the ``U`` units with replacement, the same draw for every model,
and recomputes each model's perplexity ``exp(sum of losses / number of tokens)`` on it. The
percentile interval of the differences to the first model over the samples is the confidence
interval, and the share of samples whose difference has the other sign (or none) is how often the
ordering flips. Beside it, a t-interval over the units from the difference's jackknife standard error,
which stays honest where the units are few (27 blocks of 8192 tokens) and the percentile interval runs narrow.

Several training runs of each model (seeds) are compared run by run, the ``k``-th run of every model
together (runs with the same seed see the same batches in the same order), and summarised across
runs: each model's mean perplexity and its standard deviation over seeds, and the same for its
difference to the first model. The bootstrap interval of one run measures the evaluation's noise
(which tokens were scored); the spread over seeds measures the training's.
"""

import functools
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, NamedTuple, Sequence, Tuple

import numpy as np

from kerple_fairseq.errors import UsageError
from kerple_fairseq.evaluation.per_token import TokenScores
from kerple_fairseq.evaluation.span_losses import SpanLosses

MAX_DRAWS_AT_ONCE = 4_000_000  # unit indices drawn per chunk of samples (bounds memory)
#: resamples of the boards' intervals: enough that no verdict on either committed board changes with the
#: bootstrap's seed (tests/test_committed_boards.py tries 20 seeds)
BOARD_SAMPLES = 10_000


def resample_weights(num_units: int, samples: int, seed: int):
    """The paired bootstrap's draws, chunk by chunk: ``[chunk, units]``, how often each of ``samples``
    resamples drew each unit (``units`` draws with replacement each; the same for every caller with the same
    ``seed`` and number of units)."""
    rng = np.random.default_rng(seed)
    chunk = max(1, MAX_DRAWS_AT_ONCE // num_units)
    for first in range(0, samples, chunk):
        rows = min(chunk, samples - first)
        draws = rng.integers(0, num_units, size=(rows, num_units)) + num_units * np.arange(rows)[:, None]
        yield np.bincount(draws.ravel(), minlength=rows * num_units).reshape(rows, num_units)


def identity(x):
    return x


def bootstrap_perplexities(losses: np.ndarray, counts: np.ndarray, samples: int, seed: int,
                           transform: Callable = np.exp) -> np.ndarray:
    """``[samples, models]`` perplexities of ``losses`` (``[models, units]`` summed losses, ``counts``
    tokens per unit) on ``samples`` paired resamples of the units; with another ``transform`` of the
    mean per token (:func:`identity`: summed correct answers give accuracies), that."""
    out = []
    for weights in resample_weights(counts.size, samples, seed):
        weights = weights.astype(np.float64)
        out.append(transform(weights @ losses.T / (weights @ counts)[:, None]))
    return np.concatenate(out)


@functools.lru_cache(maxsize=None)
def student_t_quantile(probability: float, df: int) -> float:
    """The ``probability`` quantile (above one half) of Student's t distribution with ``df`` degrees of freedom:
    the root of its distribution function ``1/2 + integral from 0 to x of its density`` (Simpson's rule on
    20,000 intervals), found by bisection."""
    log_scale = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def distribution(x):
        grid = np.linspace(0.0, x, 20_001)
        density = np.exp(log_scale - (df + 1) / 2 * np.log1p(grid ** 2 / df))
        return 0.5 + (density[0] + density[-1] + 4 * density[1:-1:2].sum() + 2 * density[2:-1:2].sum()) * x / 60_000

    low, high = 0.0, 1.0
    while distribution(high) < probability:
        low, high = high, 2 * high
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if distribution(middle) < probability else (low, middle)
    return (low + high) / 2


def jackknife_t_interval(losses: np.ndarray, counts: np.ndarray, confidence: float,
                         transform: Callable = np.exp) -> List[float]:
    """The t-interval over units of the perplexity difference ``model - reference`` (``losses``: ``[2, units]``,
    the reference's first): the difference plus or minus Student's t quantile with ``units - 1`` degrees of
    freedom times the difference's delete-one jackknife standard error (Efron and Tibshirani, "An Introduction
    to the Bootstrap", 1993, ch. 11). Wider than the percentile bootstrap's where the units are few; NaN for
    fewer than two units."""
    num_units = counts.size
    if num_units < 2:
        return [math.nan, math.nan]
    totals, tokens = losses.sum(axis=1), counts.sum()
    left_out = transform((totals[:, None] - losses) / (tokens - counts))  # [2, units]: each unit left out
    differences = left_out[1] - left_out[0]
    error = math.sqrt((num_units - 1) / num_units * ((differences - differences.mean()) ** 2).sum())
    at = math.exp if transform is np.exp else transform  # of one number, as the committed boards computed it
    difference = at(totals[1] / tokens) - at(totals[0] / tokens)
    half = student_t_quantile((1 + confidence) / 2, num_units - 1) * error
    return [difference - half, difference + half]


#: how many Monte-Carlo standard errors a bootstrap endpoint is moved inward (99.9% of a normal's mass within)
MONTE_CARLO_Z = 3.29


class PairedDifference(NamedTuple):
    """A perplexity difference ``model - reference`` with its intervals: the percentile bootstrap's, the same with
    each endpoint moved inward by its Monte-Carlo error (the narrowest the bootstrap's interval could be with
    endless resamples), and the t-interval over units."""

    difference: float
    bootstrap: List[float]
    bootstrap_inner: List[float]
    t: List[float]


def paired_differences(losses: np.ndarray, counts: np.ndarray, pairs: Sequence[Tuple[int, int]], samples: int,
                       seed: int, confidence: float, transform: Callable = np.exp) -> List[PairedDifference]:
    """Each ``(reference, model)`` pair of rows of ``losses`` (``[runs, units]``, every run scored on the same
    units) over one paired bootstrap of every run (``transform``: see :func:`bootstrap_perplexities`). A percentile endpoint of ``samples`` resamples is an order
    statistic: its Monte-Carlo error spans :data:`MONTE_CARLO_Z` binomial standard errors of its rank."""
    observed = transform(losses.sum(axis=1) / counts.sum())
    boot = bootstrap_perplexities(losses, counts, samples, seed, transform)
    tail = (1 - confidence) / 2
    inward = MONTE_CARLO_Z * math.sqrt(tail * (1 - tail) / samples)
    quantiles = 100 * np.array([tail, 1 - tail, min(tail + inward, 0.5), max(1 - tail - inward, 0.5)])
    out = []
    for reference, model in pairs:
        low, high, inner_low, inner_high = np.percentile(boot[:, model] - boot[:, reference], quantiles).tolist()
        out.append(PairedDifference(float(observed[model] - observed[reference]), [low, high], [inner_low, inner_high],
                                    jackknife_t_interval(losses[[reference, model]], counts, confidence, transform)))
    return out


@dataclass
class Comparison:
    """Each model against the first (``baseline``) at one protocol and length."""

    protocol: str
    length: int
    labels: List[str]
    perplexities: List[float]
    num_tokens: int
    num_units: int
    samples: int
    confidence: float
    difference: List[float]  # ppl - the first model's
    difference_interval: List[List[float]]  # the percentile bootstrap's
    difference_t_interval: List[List[float]]  # the t-interval over units (jackknife_t_interval)
    ratio: List[float]  # ppl / the first model's
    ratio_interval: List[List[float]]
    ordering_flips: List[float]  # share of samples whose difference has another sign
    replicate: int = 1  # which training run of each model (the k-th seed of every model)

    def as_dict(self) -> Dict:
        return dict(self.__dict__)


@dataclass
class SeedSpread:
    """Each model over its training runs at one protocol and length, and its difference to the first
    model run by run."""

    protocol: str
    length: int
    labels: List[str]
    runs: int
    mean: List[float]  # mean perplexity over runs
    sd: List[float]  # its sample standard deviation (ddof 1)
    difference_mean: List[float]  # mean over runs of (ppl - the first model's ppl of the same run)
    difference_sd: List[float]
    difference_range: List[List[float]]  # smallest and largest difference of a run
    same_sign: List[int]  # runs whose difference has the sign of the mean difference

    def as_dict(self) -> Dict:
        return dict(self.__dict__)


def across_seeds(runs: Sequence[Comparison]) -> SeedSpread:
    """The spread over ``runs``: comparisons of the same models, protocol and length, one per seed."""
    if len(runs) < 2:
        raise UsageError("a spread over seeds needs at least two runs of each model")
    first = runs[0]
    if any((c.protocol, c.length, c.labels) != (first.protocol, first.length, first.labels) for c in runs):
        raise UsageError("the runs of a spread over seeds must compare the same models at the same protocol and length")
    ppl = np.array([c.perplexities for c in runs])  # [runs, models]
    difference = ppl[:, 1:] - ppl[:, :1]
    mean_difference = difference.mean(axis=0)
    return SeedSpread(
        protocol=first.protocol, length=first.length, labels=list(first.labels), runs=len(runs),
        mean=ppl.mean(axis=0).tolist(), sd=ppl.std(axis=0, ddof=1).tolist(),
        difference_mean=mean_difference.tolist(), difference_sd=difference.std(axis=0, ddof=1).tolist(),
        difference_range=np.stack([difference.min(axis=0), difference.max(axis=0)], axis=1).tolist(),
        same_sign=(np.sign(difference) == np.sign(mean_difference)).sum(axis=0).tolist(),
    )


def compare(protocol: str, length: int, labels: Sequence[str], scored: Sequence[TokenScores],
            samples: int = 1000, seed: int = 1, confidence: float = 0.95, replicate: int = 1) -> Comparison:
    """The paired bootstrap of ``scored`` (one per model, the first the baseline; the ``replicate``-th
    training run of each)."""
    return compare_spans(protocol, length, labels, [SpanLosses.of(s) for s in scored], samples, seed, confidence,
                         replicate)


def check_same_tokens(protocol: str, length: int, labels: Sequence[str], scored: Sequence[SpanLosses]) -> None:
    """A :class:`UsageError` unless every one of ``scored`` scored the first one's tokens."""
    for label, s in zip(labels[1:], scored[1:]):
        if s.tokens != scored[0].tokens:
            raise UsageError(f"{label} and {labels[0]} scored different tokens under {protocol} at length "
                             f"{length}; compare files of the same split, protocol, length and --num-targets")


def compare_spans(protocol: str, length: int, labels: Sequence[str], scored: Sequence[SpanLosses],
                  samples: int = 1000, seed: int = 1, confidence: float = 0.95, replicate: int = 1) -> Comparison:
    """:func:`compare` on each model's span losses, which must come from the same scored tokens."""
    if len(scored) < 2:
        raise UsageError("compare needs at least two models")
    if not 0 < confidence < 1:
        raise UsageError(f"the confidence level must be between 0 and 1, got {confidence}")
    check_same_tokens(protocol, length, labels, scored)
    counts = scored[0].count
    num_units = counts.size
    losses = np.stack([s.loss for s in scored])  # [models, units]
    observed = np.exp(losses.sum(axis=1) / counts.sum())
    boot = bootstrap_perplexities(losses, counts, samples, seed)
    tails = [100 * (1 - confidence) / 2, 100 * (1 + confidence) / 2]
    difference, ratio = boot[:, 1:] - boot[:, :1], boot[:, 1:] / boot[:, :1]
    observed_difference = observed[1:] - observed[0]
    flips = (np.sign(difference) != np.sign(observed_difference)).mean(axis=0)
    return Comparison(
        protocol=protocol, length=length, labels=list(labels), perplexities=observed.tolist(),
        num_tokens=int(counts.sum()), num_units=num_units, samples=samples, confidence=confidence,
        difference=observed_difference.tolist(),
        difference_interval=np.percentile(difference, tails, axis=0).T.tolist(),
        difference_t_interval=[jackknife_t_interval(losses[[0, k]], counts, confidence) for k in range(1, len(scored))],
        ratio=(observed[1:] / observed[0]).tolist(),
        ratio_interval=np.percentile(ratio, tails, axis=0).T.tolist(),
        ordering_flips=flips.tolist(), replicate=replicate,
    )


def format_comparison(c: Comparison, runs: int = 1) -> str:
    """``c`` as a text table; with ``runs`` > 1 the header says which run of each model it compares."""
    level = f"{100 * c.confidence:g}%"
    run = f", run {c.replicate} of {runs}" if runs > 1 else ""
    lines = [f"{c.protocol} L={c.length}{run}: {c.num_tokens} tokens in {c.num_units} units, paired bootstrap of "
             f"{c.samples} samples",
             f"  {'model':<24} {'ppl':>9} {'- ' + c.labels[0]:>12} {level + ' bootstrap':>22} "
             f"{level + ' t over units':>22} {'ratio':>7} {'flips':>6}",
             f"  {c.labels[0]:<24} {c.perplexities[0]:>9.3f}"]
    for k, label in enumerate(c.labels[1:]):
        low, high = c.difference_interval[k]
        t_low, t_high = c.difference_t_interval[k]
        lines.append(f"  {label:<24} {c.perplexities[k + 1]:>9.3f} {c.difference[k]:>+12.3f} "
                     f"{f'[{low:+.3f}, {high:+.3f}]':>22} {f'[{t_low:+.3f}, {t_high:+.3f}]':>22} "
                     f"{c.ratio[k]:>7.4f} {c.ordering_flips[k]:>6.3f}")
    return "\n".join(lines)


def format_seed_spread(s: SeedSpread) -> str:
    lines = [f"{s.protocol} L={s.length}, over {s.runs} seeds: mean and standard deviation of each model's "
             f"perplexity, and of its difference to {s.labels[0]} seed by seed",
             f"  {'model':<24} {'mean ppl':>9} {'sd':>7} {'- ' + s.labels[0]:>12} {'sd':>7} {'range':>20} "
             f"{'same sign':>9}",
             f"  {s.labels[0]:<24} {s.mean[0]:>9.3f} {s.sd[0]:>7.3f}"]
    for k, label in enumerate(s.labels[1:]):
        low, high = s.difference_range[k]
        lines.append(f"  {label:<24} {s.mean[k + 1]:>9.3f} {s.sd[k + 1]:>7.3f} {s.difference_mean[k]:>+12.3f} "
                     f"{s.difference_sd[k]:>7.3f} {f'[{low:+.3f}, {high:+.3f}]':>20} "
                     f"{f'{s.same_sign[k]}/{s.runs}':>9}")
    return "\n".join(lines)
