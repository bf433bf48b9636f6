"""One table of many models, each trained with several seeds: which extrapolate, in what order, and
which differences survive a change of seed.

For each model, protocol and evaluated length: the mean perplexity over its seeds and their sample
standard deviation (a model may have fewer seeds than another); the model's rank (1: lowest mean) at the training length (the shortest
evaluated length if the training length was not evaluated) and at the longest length; its change
from the one to the other. Against each of its references (ALiBi, and the
baseline of its own family: rotary for the rotary family, the underlying kernel for DAPE), seed by
seed: the difference in perplexity with its paired-bootstrap interval (each seed of the model against
the same seed of the reference, on the same scored tokens, over the seeds both have; see
:mod:`significance`) and its t-interval over the units; each seed's interval is the more conservative of the
two at each end, the bootstrap's endpoints first moved inward by their Monte-Carlo error, so that no
verdict depends on the bootstrap's seed. The verdict on a difference is *resolved* when its sign is the same in
every compared seed and every seed's interval excludes zero, and *not resolved* otherwise.
"""

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Sequence, Tuple

import numpy as np

from kerple_fairseq.analysis import significance
from kerple_fairseq.errors import UsageError
from kerple_fairseq.evaluation.span_losses import SpanLosses
from kerple_fairseq.evaluation.spans import PROTOCOLS

RESOLVED, NOT_RESOLVED = "resolved", "not resolved"


@dataclass
class Entrant:
    """A model on the board: its ``name`` (as the comparison knows it), table ``label``, ``family``,
    the names it is compared against, and its kerple-eval-lm records by seed."""

    name: str
    label: str
    family: str
    references: List[str]
    records: Dict[int, List[dict]]


@dataclass
class Versus:
    """A model against a reference at one protocol and length, seed by seed."""

    model: str
    reference: str
    protocol: str
    length: int
    seeds: List[int]  # those both were trained with
    difference: List[float]  # model's perplexity - reference's, in the order of seeds
    bootstrap_interval: List[List[float]]  # its paired-bootstrap (percentile) interval, in the order of seeds
    bootstrap_inner: List[List[float]]  # the same, each endpoint moved inward by its Monte-Carlo error
    t_interval: List[List[float]]  # its t-interval over the units, in the order of seeds
    units: int  # the units both resample (blocks, or last-token targets)

    @property
    def interval(self) -> List[List[float]]:
        """Each seed's deciding interval, the more conservative at each end of the t-interval and the bootstrap's
        moved inward by its Monte-Carlo error: so the bootstrap widens it only where it is wider beyond what
        another bootstrap seed could change."""
        return [[min(b[0], t[0]), max(b[1], t[1])] for b, t in zip(self.bootstrap_inner, self.t_interval)]

    @property
    def verdict(self) -> str:
        above = all(d > 0 and low > 0 for d, (low, _) in zip(self.difference, self.interval))
        below = all(d < 0 and high < 0 for d, (_, high) in zip(self.difference, self.interval))
        return RESOLVED if self.difference and (above or below) else NOT_RESOLVED


@dataclass
class Leaderboard:
    seeds: List[int]  # every seed some model was trained with
    train_length: int  # the training length, or the shortest evaluated length if it was not evaluated
    lengths: List[int]
    protocols: List[str]  # those evaluated, in kerple-eval-lm's order
    entrants: List[Entrant]
    confidence: float
    ppl: Dict[Tuple[str, str, int], List[float]] = field(default_factory=dict)  # (model, protocol, length): by seed
    versus: List[Versus] = field(default_factory=list)

    @property
    def longest(self) -> int:
        return max(self.lengths)

    def mean(self, model: str, protocol: str, length: int) -> float:
        return float(np.mean(self.ppl[model, protocol, length]))

    def sd(self, model: str, protocol: str, length: int) -> float:
        """The sample standard deviation over seeds (NaN for one seed)."""
        values = self.ppl[model, protocol, length]
        return float(np.std(values, ddof=1)) if len(values) > 1 else float("nan")

    def ranks(self, protocol: str, length: int, among: Sequence[str] = ()) -> Dict[str, int]:
        """1 for the lowest mean perplexity among the models ``among`` (default: every entrant); ties share the
        better rank; a model that diverged (NaN) ranks last."""
        means = {name: self.mean(name, protocol, length) for name in among or [e.name for e in self.entrants]}
        means = {name: math.inf if math.isnan(m) else m for name, m in means.items()}
        return {name: 1 + sum(other < m for other in means.values()) for name, m in means.items()}

    def change(self, model: str, protocol: str) -> float:
        """Mean perplexity at the longest length over that at the training length, less one."""
        return self.mean(model, protocol, self.longest) / self.mean(model, protocol, self.train_length) - 1

    def against(self, model: str, protocol: str, length: int) -> List[Versus]:
        return [v for v in self.versus if (v.model, v.protocol, v.length) == (model, protocol, length)]

    def seeds_of(self, model: str) -> List[int]:
        return sorted(next(e for e in self.entrants if e.name == model).records)


Scores = Callable[[str, int], Dict[Tuple[str, int], SpanLosses]]  # (model, seed): span losses by (protocol, length)


def compared(pairs: Sequence[Tuple[str, str, Sequence[int]]], protocol: str, length: int, scores: Scores,
             samples: int = significance.BOARD_SAMPLES, bootstrap_seed: int = 1,
             confidence: float = 0.95, transform=np.exp) -> List[Versus]:
    """Each ``(model, reference, seeds)`` of ``pairs`` at ``protocol`` and ``length``, each seed of the model paired
    with the same seed of the reference; one paired bootstrap resamples every run involved (``transform``: of
    each run's mean per token, see :func:`~kerple_fairseq.analysis.significance.bootstrap_perplexities`)."""
    runs = list(dict.fromkeys((name, seed) for model, reference, seeds in pairs
                              for seed in seeds for name in (reference, model)))
    if not runs:
        return [Versus(model, reference, protocol, length, [], [], [], [], [], 0) for model, reference, _ in pairs]
    spans = [scores(name, seed)[protocol, length] for name, seed in runs]
    significance.check_same_tokens(protocol, length, [f"{name} (seed {seed})" for name, seed in runs], spans)
    column = {run: k for k, run in enumerate(runs)}
    counts = spans[0].count
    found = significance.paired_differences(
        np.stack([s.loss for s in spans]), counts,
        [(column[reference, seed], column[model, seed]) for model, reference, seeds in pairs for seed in seeds],
        samples, bootstrap_seed, confidence, transform)
    out, k = [], 0
    for model, reference, seeds in pairs:
        mine = found[k:k + len(seeds)]
        out.append(Versus(model, reference, protocol, length, list(seeds), [f.difference for f in mine],
                          [f.bootstrap for f in mine], [f.bootstrap_inner for f in mine], [f.t for f in mine],
                          int(counts.size)))
        k += len(seeds)
    return out


def paired(model: str, reference: str, protocol: str, length: int, seeds: Sequence[int], scores: Scores,
           samples: int = significance.BOARD_SAMPLES, bootstrap_seed: int = 1, confidence: float = 0.95) -> Versus:
    """``model`` against ``reference`` at ``protocol`` and ``length``, each of ``seeds`` paired with itself."""
    return compared([(model, reference, seeds)], protocol, length, scores, samples, bootstrap_seed, confidence)[0]


def build(entrants: Sequence[Entrant], train_length: int, scores: Scores,
          samples: int = significance.BOARD_SAMPLES, bootstrap_seed: int = 1, confidence: float = 0.95) -> Leaderboard:
    """The board of ``entrants``; ``scores(name, seed)`` gives the span losses of model ``name`` trained
    with ``seed`` by protocol and length."""
    by_name = {e.name: e for e in entrants}
    every = [records for e in entrants for records in e.records.values()]
    lengths = sorted({r["length"] for records in every for r in records})
    protocols = [p for p in PROTOCOLS if any(r["protocol"] == p for records in every for r in records)]
    if not lengths:
        raise UsageError("the leaderboard needs evaluated lengths")
    short = train_length if train_length in lengths else lengths[0]
    seeds = sorted({seed for e in entrants for seed in e.records})
    board = Leaderboard(seeds, short, lengths, protocols, list(entrants), confidence)
    for e in entrants:
        for protocol in protocols:
            for n in lengths:
                ppl = [next((r["ppl"] for r in e.records[seed] if (r["protocol"], r["length"]) == (protocol, n)), None)
                       for seed in sorted(e.records)]
                if None in ppl:
                    raise UsageError(f"{e.name} lacks {protocol} at L={n} in some seed")
                board.ppl[e.name, protocol, n] = ppl
    pairs = [(e.name, reference, sorted(set(e.records) & set(by_name[reference].records)))
             for e in entrants for reference in dict.fromkeys(r for r in e.references if r in by_name and r != e.name)]
    at = {(p, n): compared(pairs, p, n, scores, samples, bootstrap_seed, confidence) for p in protocols for n in lengths}
    board.versus = [at[p, n][k] for k in range(len(pairs)) for p in protocols for n in lengths]
    return board


def _mean_sd(board: Leaderboard, model: str, protocol: str, length: int) -> str:
    sd = board.sd(model, protocol, length)
    return f"{board.mean(model, protocol, length):.2f}" + ("" if np.isnan(sd) else f" ± {sd:.2f}")


def _versus_cell(board: Leaderboard, v: Versus) -> str:
    fewer = f" ({len(v.seeds)} seed{'s' * (len(v.seeds) != 1)})" if len(v.seeds) < len(board.seeds) else ""
    return f"{np.mean(v.difference):+.2f}, {v.verdict}{fewer}" if v.seeds else "no common seed"


def markdown(board: Leaderboard, protocol: str) -> str:
    """The board under ``protocol``, best first at the longest length: ranks, mean ± sd at the training
    and the longest length, the change between them, and the mean difference to each reference at the
    longest length with its verdict."""
    labels = {e.name: e.label for e in board.entrants}
    short, long_ = board.train_length, board.longest
    at_short, at_long = board.ranks(protocol, short), board.ranks(protocol, long_)
    lines = [f"| rank L={long_} | rank L={short} | model | L={short} | L={long_} | {short} → {long_} | "
             f"− ALiBi at {long_} | − family baseline at {long_} |",
             "|---|---|---|---|---|---|---|---|"]
    for e in sorted(board.entrants, key=lambda e: (at_long[e.name], e.name)):
        cells = {v.reference: v for v in board.against(e.name, protocol, long_)}
        baseline = next((r for r in e.references if r != "alibi" and r in cells), None)
        lines.append(" | ".join([
            f"| {at_long[e.name]}", str(at_short[e.name]), e.label, _mean_sd(board, e.name, protocol, short),
            _mean_sd(board, e.name, protocol, long_), f"{100 * board.change(e.name, protocol):+.1f}%",
            _versus_cell(board, cells["alibi"]) if "alibi" in cells else "",
            f"{labels[baseline]}: {_versus_cell(board, cells[baseline])}" if baseline else ""]) + " |")
    return "\n".join(lines)


def seed_markdown(board: Leaderboard, protocol: str, length: int) -> str:
    """Every difference to a reference at ``length``, seed by seed, with its deciding interval
    (:attr:`Versus.interval`) and the number of units resampled."""
    labels = {e.name: e.label for e in board.entrants}
    level = f"{100 * board.confidence:g}%"
    lines = ["| model | − reference | " + " | ".join(f"seed {s} ({level} interval)" for s in board.seeds)
             + " | units | verdict |", "|---|---|" + "---|" * len(board.seeds) + "---|---|"]
    for v in board.versus:
        if (v.protocol, v.length) == (protocol, length):
            cells = {seed: f"{d:+.2f} [{low:+.2f}, {high:+.2f}]"
                     for seed, d, (low, high) in zip(v.seeds, v.difference, v.interval)}
            seeds = [cells.get(seed, "") for seed in board.seeds]
            lines.append(f"| {labels[v.model]} | {labels[v.reference]} | " + " | ".join(seeds)
                         + f" | {v.units} | {v.verdict} |")
    return "\n".join(lines)


def lengths_markdown(board: Leaderboard) -> str:
    """Every model's mean ± sd at every length, under each protocol, in the board's order of models."""
    lines = ["| model | protocol | " + " | ".join(f"L={n}" for n in board.lengths) + " |",
             "|---|---|" + "---|" * len(board.lengths)]
    for e in board.entrants:
        for protocol in board.protocols:
            lines.append(f"| {e.label} | {protocol} | "
                         + " | ".join(_mean_sd(board, e.name, protocol, n) for n in board.lengths) + " |")
    return "\n".join(lines)


def csv_rows(board: Leaderboard) -> Tuple[List[str], List[list]]:
    """A row per model, protocol and length: mean, sd, its seeds and each one's perplexity, ranks there, and
    for each reference the seeds compared, their differences, intervals (the deciding one, the bootstrap's, the
    bootstrap's moved inward by its Monte-Carlo error, the t-interval) and verdict (``;``-separated by seed),
    and the units resampled. The intervals, whose last
    digits differ from one NumPy to another, are written to 10 significant digits."""
    header = ["model", "label", "family", "protocol", "length", "mean", "sd", "seeds", "ppl_by_seed", "rank",
              "reference", "compared_seeds", "difference_by_seed", "interval_by_seed", "verdict",
              "bootstrap_interval_by_seed", "bootstrap_inner_by_seed", "t_interval_by_seed", "units"]
    rows = []
    for protocol in board.protocols:
        for n in board.lengths:
            ranks = board.ranks(protocol, n)
            for e in board.entrants:
                common = [e.name, e.label, e.family, protocol, n, repr(board.mean(e.name, protocol, n)),
                          repr(board.sd(e.name, protocol, n)), ";".join(map(str, sorted(e.records))),
                          ";".join(map(repr, board.ppl[e.name, protocol, n])), ranks[e.name]]
                rows.append(common + [""] * 9)
                for v in board.against(e.name, protocol, n):
                    rows.append(common + [v.reference, ";".join(map(str, v.seeds)), ";".join(map(repr, v.difference)),
                                          _intervals(v.interval), v.verdict, _intervals(v.bootstrap_interval),
                                          _intervals(v.bootstrap_inner), _intervals(v.t_interval), v.units])
    return header, rows


def _intervals(intervals: Sequence[Sequence[float]]) -> str:
    return ";".join(f"{low:.10g}/{high:.10g}" for low, high in intervals)
