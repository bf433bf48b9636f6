"""The retrieval board: each model's accuracy on the retrieval tasks at every length, mean and sample standard
deviation over its seeds, ranked, and compared with ALiBi seed by seed.

A model's rank in a task is by its mean accuracy over the lengths beyond the training length (2x to 32x:
what it retrieves from farther back than it was trained on; 1 is the best, ties share it). Each seed's
difference to ALiBi's run of the same seed (model - ALiBi, in accuracy) has the perplexity board's interval
(:class:`~kerple_fairseq.analysis.leaderboard.Versus`: a paired bootstrap over the examples, moved inward by
its Monte-Carlo error, and a t-interval over them, the more conservative at each end); it is *resolved*
when every seed has the same sign and an interval excluding zero."""

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from kerple_fairseq.analysis import leaderboard, significance
from kerple_fairseq.analysis.leaderboard import RESOLVED, Versus
from kerple_fairseq.errors import UsageError
from kerple_fairseq.evaluation.retrieval_accuracy import ExampleScores
from kerple_fairseq.evaluation.span_losses import SpanLosses
from kerple_fairseq.tasks.retrieval_sequences import TASKS

REFERENCE = "alibi"

Run = Tuple[str, int]  # a model and its seed
#: a run's example-scores file, read: what drew the examples, and the scores by task and length
ScoresOf = Callable[[str, int], Tuple[dict, Dict[Tuple[str, int], ExampleScores]]]


@dataclass
class Entrant:
    name: str
    label: str
    family: str
    seeds: List[int]


@dataclass
class RetrievalBoard:
    train_length: int
    tasks: List[str]
    lengths: List[int]
    entrants: List[Entrant]
    confidence: float
    accuracy: Dict[Tuple[str, str, int], List[float]] = field(default_factory=dict)  # (model, task, length): by seed
    versus: List[Versus] = field(default_factory=list)  # each model but ALiBi against it (protocol: the task)

    @property
    def beyond(self) -> List[int]:
        """The lengths beyond the training length (every length where none is)."""
        return [n for n in self.lengths if n > self.train_length] or list(self.lengths)

    def mean(self, model: str, task: str, length: int) -> float:
        return float(np.mean(self.accuracy[model, task, length]))

    def sd(self, model: str, task: str, length: int) -> float:
        values = self.accuracy[model, task, length]
        return float(np.std(values, ddof=1)) if len(values) > 1 else math.nan

    def beyond_mean(self, model: str, task: str) -> float:
        """The mean over the seeds of the mean accuracy over :attr:`beyond`."""
        return float(np.mean([self.mean(model, task, n) for n in self.beyond]))

    def ranks(self, score: Callable[[str], float]) -> Dict[str, int]:
        """1 for the highest ``score`` of a model; ties share the better rank."""
        scores = {e.name: score(e.name) for e in self.entrants}
        return {name: 1 + sum(other > s for other in scores.values()) for name, s in scores.items()}

    def against(self, model: str, task: str, length: int) -> Optional[Versus]:
        return next((v for v in self.versus if (v.model, v.protocol, v.length) == (model, task, length)), None)


def check_same_examples(task: str, length: int, runs: Sequence[Run],
                        found: Sequence[Tuple[dict, ExampleScores]]) -> None:
    """A :class:`UsageError` unless every run answered the same examples, drawn alike."""
    (meta, first), (name, seed) = found[0], runs[0]
    for (other_meta, other), (other_name, other_seed) in zip(found[1:], runs[1:]):
        if other_meta != meta or not np.array_equal(other.answers, first.answers):
            raise UsageError(f"{name} (seed {seed}) and {other_name} (seed {other_seed}) answered different {task} "
                             f"examples at length {length}: evaluate them with the same kerple-eval-lm --task "
                             "retrieval options")


def units(read: Dict[Run, Tuple[dict, Dict[Tuple[str, int], ExampleScores]]]) -> leaderboard.Scores:
    """The runs' example scores as the units of :func:`~kerple_fairseq.analysis.leaderboard.compared`: each
    example's right answers summed where a perplexity's loss would be, its answers counted as its tokens."""
    def of(name: str, seed: int) -> Dict[Tuple[str, int], SpanLosses]:
        meta, scores = read[name, seed]
        drawn = hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()
        return {key: SpanLosses(s.correct.astype(np.float64), s.answers.astype(np.int64), drawn)
                for key, s in scores.items()}
    return of


def build(entrants: Sequence[Entrant], train_length: int, scores_of: ScoresOf, bootstrap_seed: int = 1,
          confidence: float = 0.95, samples: int = significance.BOARD_SAMPLES) -> RetrievalBoard:
    """The board of ``entrants`` (ALiBi among them for the comparisons), each run's example scores by
    ``scores_of``: one paired bootstrap per task and length over every run."""
    runs = [(e.name, seed) for e in entrants for seed in e.seeds]
    read = {run: scores_of(*run) for run in runs}
    keys = set.intersection(*(set(found) for _, found in read.values()))
    tasks = [task for task in TASKS if any(t == task for t, _ in keys)]
    board = RetrievalBoard(train_length, tasks, sorted({n for _, n in keys}), list(entrants), confidence)
    seeds_of = {e.name: e.seeds for e in entrants}
    pairs = [(e.name, REFERENCE, [s for s in e.seeds if s in seeds_of[REFERENCE]])
             for e in entrants if e.name != REFERENCE and REFERENCE in seeds_of]
    for task, length in sorted(keys):
        found = [(read[run][0], read[run][1][task, length]) for run in runs]
        check_same_examples(task, length, runs, found)
        for (name, seed), (_, s) in zip(runs, found):
            board.accuracy.setdefault((name, task, length), []).append(float(s.correct.sum() / s.answers.sum()))
        board.versus += leaderboard.compared([p for p in pairs if p[2]], task, length, units(read), samples,
                                             bootstrap_seed, confidence, significance.identity)
    return board


def _percent(x: float) -> str:
    return "" if math.isnan(x) else f"{100 * x:.1f}"


def _cell(board: RetrievalBoard, name: str, task: str, length: int) -> str:
    mean, sd = board.mean(name, task, length), board.sd(name, task, length)
    v = board.against(name, task, length)
    mark = ""
    if v is not None and v.verdict == RESOLVED:
        mark = " ▲" if v.difference[0] > 0 else " ▼"
    return f"{_percent(mean)}{'' if math.isnan(sd) else ' ± ' + _percent(sd)}{mark}"


def markdown(board: RetrievalBoard, task: str, perplexity_rank: Dict[str, int]) -> str:
    """A task's table: the models by rank, their accuracy (%) at every length, ▲/▼ where resolved above or below
    ALiBi, and the perplexity board's rank of each (blank where it holds none)."""
    ranks = board.ranks(lambda name: board.beyond_mean(name, task))
    lines = ["| rank | model | family | " + " | ".join(f"L={n}" for n in board.lengths)
             + f" | mean beyond L={board.train_length} | perplexity rank |",
             "|" + "---|" * (len(board.lengths) + 5)]
    for e in sorted(board.entrants, key=lambda e: ranks[e.name]):
        cells = [_cell(board, e.name, task, n) for n in board.lengths]
        lines.append(f"| {ranks[e.name]} | {e.label} | {e.family} | " + " | ".join(cells)
                     + f" | {_percent(board.beyond_mean(e.name, task))} | {perplexity_rank.get(e.name, '')} |")
    return "\n".join(lines)


def seed_markdown(board: RetrievalBoard, task: str, length: int, labels: Dict[str, str]) -> str:
    """Each model's difference to ALiBi at ``length``, seed by seed, in accuracy points, with its interval."""
    lines = ["| model | seeds | difference to ALiBi (points) | intervals | verdict |", "|---|---|---|---|---|"]
    for v in (v for v in board.versus if v.protocol == task and v.length == length):
        lines.append(f"| {labels[v.model]} | {', '.join(map(str, v.seeds))} | "
                     + ", ".join(f"{100 * d:+.1f}" for d in v.difference) + " | "
                     + ", ".join(f"[{100 * lo:+.1f}, {100 * hi:+.1f}]" for lo, hi in v.interval) + f" | {v.verdict} |")
    return "\n".join(lines)


def csv_rows(board: RetrievalBoard) -> Tuple[List[str], List[list]]:
    header = ["model", "label", "family", "task", "length", "mean", "sd", "seeds", "accuracy_by_seed", "rank",
              "reference", "compared_seeds", "difference_by_seed", "interval_by_seed", "verdict", "units"]
    rows = []
    for task in board.tasks:
        ranks = board.ranks(lambda name: board.beyond_mean(name, task))
        for e in board.entrants:
            for n in board.lengths:
                v = board.against(e.name, task, n)
                rows.append([e.name, e.label, e.family, task, n, board.mean(e.name, task, n), board.sd(e.name, task, n),
                             ";".join(map(str, e.seeds)), ";".join(map(str, board.accuracy[e.name, task, n])),
                             ranks[e.name], *(["", "", "", "", "", ""] if v is None else [
                                 v.reference, ";".join(map(str, v.seeds)), ";".join(map(str, v.difference)),
                                 ";".join(f"{lo} {hi}" for lo, hi in v.interval), v.verdict, v.units])])
    return header, rows


def depth_markdown(board: RetrievalBoard, task: str, records: Dict[Run, List[dict]]) -> str:
    """A task's accuracy (%) by the answer's depth, over the lengths beyond the training length pooled (from each
    run's kerple-eval-lm records), mean over the seeds: how far back a model still finds the answer, apart
    from how long its input is. Models in the order of :func:`markdown`."""
    beyond = set(board.beyond)
    bins = sorted({(d["from"], d["to"]) for rs in records.values() for r in rs
                   if r["task"] == task and r["length"] in beyond for d in r["depths"]})
    ranks = board.ranks(lambda name: board.beyond_mean(name, task))
    lines = ["| model | " + " | ".join(f"depth {lo}-{hi}" for lo, hi in bins) + " |", "|" + "---|" * (len(bins) + 1)]
    for e in sorted(board.entrants, key=lambda e: ranks[e.name]):
        cells = []
        for lo, hi in bins:
            by_seed = []
            for seed in e.seeds:
                found = [(d["accuracy"] * d["num_answers"], d["num_answers"]) for r in records[e.name, seed]
                         if r["task"] == task and r["length"] in beyond for d in r["depths"] if d["from"] == lo]
                if found:
                    by_seed.append(sum(c for c, _ in found) / sum(n for _, n in found))
            cells.append(_percent(float(np.mean(by_seed))) if by_seed else "")
        lines.append(f"| {e.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
