"""Is a perplexity difference more than noise? A paired bootstrap over the units scored together.

Models evaluated on the same split under the same protocol and length scored the same tokens in the
same spans. The spans are the units: a block of the early-token-cursed or sliding protocol (its
tokens share context, so they are not independent), a target of the last-token protocol. One
bootstrap sample draws ``U`` of the ``U`` units with replacement, the same draw for every model,
and recomputes each model's perplexity ``exp(sum of losses / number of tokens)`` on it. The
percentile interval of the differences to the first model over the samples is the confidence
interval, and the share of samples whose difference has the other sign (or none) is how often the
ordering flips.

Several training runs of each model (seeds) are compared run by run, the ``k``-th run of every model
together (runs with the same seed see the same batches in the same order), and summarised across
runs: each model's mean perplexity and its standard deviation over seeds, and the same for its
difference to the first model. The bootstrap interval of one run measures the evaluation's noise
(which tokens were scored); the spread over seeds measures the training's.
"""

from dataclasses import dataclass
from typing import Dict, List, Sequence

import numpy as np

from kerple_fairseq.errors import UsageError
from kerple_fairseq.evaluation.per_token import TokenScores
from kerple_fairseq.evaluation.span_losses import SpanLosses

MAX_DRAWS_AT_ONCE = 4_000_000  # unit indices drawn per chunk of samples (bounds memory)


def bootstrap_perplexities(losses: np.ndarray, counts: np.ndarray, samples: int, seed: int) -> np.ndarray:
    """``[samples, models]`` perplexities of ``losses`` (``[models, units]`` summed losses, ``counts``
    tokens per unit) on ``samples`` paired resamples of the units."""
    rng = np.random.default_rng(seed)
    num_units = counts.size
    chunk = max(1, MAX_DRAWS_AT_ONCE // num_units)
    out = []
    for first in range(0, samples, chunk):
        draws = rng.integers(0, num_units, size=(min(chunk, samples - first), num_units))
        tokens = counts[draws].sum(axis=1)  # [chunk]
        totals = losses[:, draws].sum(axis=2)  # [models, chunk]
        out.append(np.exp(totals / tokens).T)
    return np.concatenate(out)


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
    difference_interval: List[List[float]]
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


def compare_spans(protocol: str, length: int, labels: Sequence[str], scored: Sequence[SpanLosses],
                  samples: int = 1000, seed: int = 1, confidence: float = 0.95, replicate: int = 1) -> Comparison:
    """:func:`compare` on each model's span losses, which must come from the same scored tokens."""
    if len(scored) < 2:
        raise UsageError("compare needs at least two models")
    if not 0 < confidence < 1:
        raise UsageError(f"the confidence level must be between 0 and 1, got {confidence}")
    for label, s in zip(labels[1:], scored[1:]):
        if s.tokens != scored[0].tokens:
            raise UsageError(f"{label} and {labels[0]} scored different tokens under {protocol} at length "
                             f"{length}; compare files of the same split, protocol, length and --num-targets")
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
             f"  {'model':<24} {'ppl':>9} {'- ' + c.labels[0]:>12} {level + ' interval':>22} {'ratio':>7} "
             f"{'flips':>6}",
             f"  {c.labels[0]:<24} {c.perplexities[0]:>9.3f}"]
    for k, label in enumerate(c.labels[1:]):
        low, high = c.difference_interval[k]
        lines.append(f"  {label:<24} {c.perplexities[k + 1]:>9.3f} {c.difference[k]:>+12.3f} "
                     f"{f'[{low:+.3f}, {high:+.3f}]':>22} {c.ratio[k]:>7.4f} {c.ordering_flips[k]:>6.3f}")
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
