"""The retrieval board: each model's whole-answer accuracy on the retrieval tasks at every length (its
per-token accuracy beside it), mean and sample standard deviation over its seeds, ranked among the models that
learned the task, and compared seed by seed with ALiBi and with the baseline of its own family (what it adds to:
rotary for a rotary scaling, RNoPE-SWA for SWAN-GPT's scaling of it, KERPLE-log for DAPE on it).

A model has *learned* a task when every seed's whole-answer accuracy at the training length reaches the
criterion; only those are ranked, by their mean whole-answer accuracy over the lengths beyond the training length
(2x to 32x: what they retrieve from farther back than they were trained on; 1 is the best, ties share it).
The others are listed below them with their accuracy at the training length. Each seed's difference to a
reference's run of the same seed (model - reference, in whole-answer accuracy) has the perplexity board's interval
(:class:`~kerple_fairseq.analysis.leaderboard.Versus`: a paired bootstrap over the examples, moved inward by
its Monte-Carlo error, and a t-interval over them, the more conservative at each end); it is *resolved* when
every seed has the same sign and an interval excluding zero, and marked only where both learned the task and
at least one of them is above chance at that length (:meth:`RetrievalBoard.at_chance`)."""

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

REFERENCE = "alibi"  # every model's first reference: the board's ▲/▼ are against it

Run = Tuple[str, int]  # a model and its seed
#: a run's example-scores file, read: what drew the examples, and the scores by task and length
ScoresOf = Callable[[str, int], Tuple[dict, Dict[Tuple[str, int], ExampleScores]]]


@dataclass
class Entrant:
    name: str
    label: str
    family: str
    seeds: List[int]
    references: List[str] = field(default_factory=lambda: [REFERENCE])  # compared against, where on the board


@dataclass
class RetrievalBoard:
    train_length: int
    tasks: List[str]
    lengths: List[int]
    entrants: List[Entrant]
    confidence: float
    criterion: float
    chance: Dict[Tuple[str, int], dict]  # (task, length): a kerple-eval-lm record's chance levels
    accuracy: Dict[Tuple[str, str, int], List[float]] = field(default_factory=dict)  # (model, task, length): by seed
    per_token: Dict[Tuple[str, str, int], List[float]] = field(default_factory=dict)  # the same, token by token
    wholes: Dict[Tuple[str, int], int] = field(default_factory=dict)  # (task, length): whole answers of a run
    versus: List[Versus] = field(default_factory=list)  # each model against its references (protocol: the task)

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

    def learned(self, model: str, task: str) -> bool:
        """Every seed's whole-answer accuracy at the training length reaches the criterion."""
        return min(self.accuracy[model, task, self.train_length]) >= self.criterion

    def at_chance(self, model: str, task: str, length: int) -> bool:
        """No seed's whole-answer accuracy is above the chance of a guess among the symbols the input shows by
        more than two binomial standard errors of that guess."""
        chance, n = self.chance[task, length]["whole"]["in_context"], self.wholes[task, length]
        return max(self.accuracy[model, task, length]) <= chance + 2 * math.sqrt(chance * (1 - chance) / n)

    def ranks(self, task: str) -> Dict[str, int]:
        """1 for the highest mean beyond the training length among the models that learned ``task``; ties share
        the better rank. Models that did not learn it have no rank."""
        scores = {e.name: self.beyond_mean(e.name, task) for e in self.entrants if self.learned(e.name, task)}
        return {name: 1 + sum(other > s for other in scores.values()) for name, s in scores.items()}

    def in_order(self, task: str) -> List[Entrant]:
        """The entrants by rank in ``task``, then those that did not learn it, best at the training length first."""
        ranks = self.ranks(task)
        return sorted(self.entrants, key=lambda e: (e.name not in ranks, ranks.get(e.name, 0),
                                                    -self.mean(e.name, task, self.train_length)))

    def marked(self, versus: Versus) -> bool:
        """Whether a verdict means something: both learned the task, and not both at chance."""
        return comparison_state(self, versus) == RESOLVED

    def against(self, model: str, task: str, length: int, reference: str = REFERENCE) -> Optional[Versus]:
        return next((v for v in self.versus
                     if (v.model, v.reference, v.protocol, v.length) == (model, reference, task, length)), None)

    def baseline_of(self, entrant: Entrant) -> Optional[str]:
        """The entrant's family baseline on this board (a reference other than ALiBi), if any."""
        return next((r for r in entrant.references if r not in (REFERENCE, entrant.name)
                     and any(e.name == r for e in self.entrants)), None)


def examples_drawn(meta: dict) -> dict:
    """What drew a run's examples, its settings written before ``depth_bands`` existed read as its default (0,
    which draws the same examples)."""
    return {**meta, "settings": {"depth_bands": 0, **meta.get("settings", {})}}


def check_same_examples(task: str, length: int, runs: Sequence[Run],
                        found: Sequence[Tuple[dict, ExampleScores]]) -> None:
    """A :class:`UsageError` unless every run answered the same examples, drawn alike."""
    (meta, first), (name, seed) = found[0], runs[0]
    for (other_meta, other), (other_name, other_seed) in zip(found[1:], runs[1:]):
        if examples_drawn(other_meta) != examples_drawn(meta) or not np.array_equal(other.answers, first.answers):
            raise UsageError(f"{name} (seed {seed}) and {other_name} (seed {other_seed}) answered different {task} "
                             f"examples at length {length}: evaluate them with the same kerple-eval-lm --task "
                             "retrieval options")


def units(read: Dict[Run, Tuple[dict, Dict[Tuple[str, int], ExampleScores]]]) -> leaderboard.Scores:
    """The runs' example scores as the units of :func:`~kerple_fairseq.analysis.leaderboard.compared`: each
    example's right whole answers summed where a perplexity's loss would be, its whole answers counted as its
    tokens (examples without a whole answer left out)."""
    def of(name: str, seed: int) -> Dict[Tuple[str, int], SpanLosses]:
        meta, scores = read[name, seed]
        drawn = hashlib.sha256(json.dumps(examples_drawn(meta), sort_keys=True).encode()).hexdigest()
        return {key: SpanLosses(s.whole_correct[s.wholes > 0].astype(np.float64),
                                s.wholes[s.wholes > 0].astype(np.int64), drawn) for key, s in scores.items()}
    return of


def build(entrants: Sequence[Entrant], train_length: int, scores_of: ScoresOf, chance: Dict[Tuple[str, int], dict],
          criterion: float, bootstrap_seed: int = 1, confidence: float = 0.95,
          samples: int = significance.BOARD_SAMPLES) -> RetrievalBoard:
    """The board of ``entrants`` (ALiBi among them for the comparisons), each run's example scores by
    ``scores_of``, the chance levels of every task and length by ``chance`` (a kerple-eval-lm record's), the
    training length among the lengths: one paired bootstrap per task and length over every run."""
    runs = [(e.name, seed) for e in entrants for seed in e.seeds]
    read = {run: scores_of(*run) for run in runs}
    keys = set.intersection(*(set(found) for _, found in read.values()))
    tasks = [task for task in TASKS if any(t == task for t, _ in keys)]
    lengths = sorted({n for _, n in keys})
    if train_length not in lengths:
        raise UsageError(f"the runs were not all evaluated at the training length {train_length}: whether a model "
                         "learned the tasks is read there")
    board = RetrievalBoard(train_length, tasks, lengths, list(entrants), confidence, criterion, dict(chance))
    seeds_of = {e.name: e.seeds for e in entrants}
    pairs = [(e.name, reference, [s for s in e.seeds if s in seeds_of[reference]])
             for e in entrants for reference in dict.fromkeys(e.references)
             if reference in seeds_of and reference != e.name]
    for task, length in sorted(keys):
        found = [(read[run][0], read[run][1][task, length]) for run in runs]
        check_same_examples(task, length, runs, found)
        if not found[0][1].wholes.sum():
            raise UsageError(f"{task} at length {length} holds no whole answer: evaluate a longer length")
        board.wholes[task, length] = int(found[0][1].wholes.sum())
        for (name, seed), (_, s) in zip(runs, found):
            board.accuracy.setdefault((name, task, length), []).append(float(s.whole_correct.sum() / s.wholes.sum()))
            board.per_token.setdefault((name, task, length), []).append(float(s.correct.sum() / s.answers.sum()))
        board.versus += leaderboard.compared([p for p in pairs if p[2]], task, length, units(read), samples,
                                             bootstrap_seed, confidence, significance.identity)
    return board


def _percent(x: Optional[float]) -> str:
    return "" if x is None or math.isnan(x) else f"{100 * x:.1f}"


def _small_percent(x: float) -> str:
    """A chance level in percent: to a tenth, to a thousandth below 0.1, and "< 0.001" below that."""
    return f"{100 * x:.1f}" if 100 * x >= 0.1 else f"{100 * x:.3f}" if 100 * x >= 0.001 else "< 0.001"


def _mark(board: RetrievalBoard, v: Optional[Versus]) -> str:
    """" ▲" or " ▼" where ``v`` is resolved and meaningful (:meth:`RetrievalBoard.marked`), else nothing."""
    return (" ▲" if v.difference[0] > 0 else " ▼") if v is not None and board.marked(v) else ""


def _cell(board: RetrievalBoard, name: str, task: str, length: int) -> str:
    mean, sd = board.mean(name, task, length), board.sd(name, task, length)
    mark = _mark(board, board.against(name, task, length))
    per_token = float(np.mean(board.per_token[name, task, length]))
    return f"{_percent(mean)}{'' if math.isnan(sd) else ' ± ' + _percent(sd)}{mark} ({_percent(per_token)})"


def markdown(board: RetrievalBoard, task: str, perplexity_rank: Dict[str, int], training: Dict[str, str],
             reasons: Optional[Dict[str, str]] = None) -> str:
    """A task's table: the models that learned it by rank, then the others; their whole-answer accuracy (%) at
    every length, per-token in brackets, ▲/▼ where resolved above or below ALiBi and meaningful
    (:meth:`RetrievalBoard.marked`), the perplexity board's rank of each (blank where it holds none) and how its
    training ended (``training``, by model), with the reason it is not ranked where ``reasons`` gives one;
    then the chance of a guess, whole, at every length."""
    ranks = board.ranks(task)
    lines = ["| rank | model | family | " + " | ".join(f"L={n}" for n in board.lengths)
             + f" | mean beyond L={board.train_length} | perplexity rank | training |",
             "|" + "---|" * (len(board.lengths) + 6)]
    for e in board.in_order(task):
        cells = [_cell(board, e.name, task, n) for n in board.lengths]
        rank = ranks.get(e.name, "not learned")
        beyond = _percent(board.beyond_mean(e.name, task)) if e.name in ranks else ""
        outcome = training.get(e.name, "")
        if e.name not in ranks and e.name in (reasons or {}):
            outcome += f"; {reasons[e.name]}"
        lines.append(f"| {rank} | {e.label} | {e.family} | " + " | ".join(cells)
                     + f" | {beyond} | {perplexity_rank.get(e.name, '')} | {outcome} |")
    for label, kind in (("guess among the symbols the input shows", "in_context"),
                        ("guess among all answer symbols", "uniform")):
        cells = [_small_percent(board.chance[task, n]["whole"][kind]) for n in board.lengths]
        lines.append(f"| | *{label}* | | " + " | ".join(cells) + " | | | |")
    return "\n".join(lines)


NOT_LEARNED, BOTH_AT_CHANCE = "not compared: not learned at the training length", "not compared: both at chance"


def comparison_state(board: RetrievalBoard, v: Versus) -> str:
    """The verdict of ``v``, or why none is given."""
    if not (board.learned(v.model, v.protocol) and board.learned(v.reference, v.protocol)):
        return NOT_LEARNED
    if board.at_chance(v.model, v.protocol, v.length) and board.at_chance(v.reference, v.protocol, v.length):
        return BOTH_AT_CHANCE
    return v.verdict


def _baseline_cell(board: RetrievalBoard, v: Optional[Versus]) -> str:
    if v is None:
        return "no common seed"
    chance = " (both at chance)" if comparison_state(board, v) == BOTH_AT_CHANCE else ""
    return f"{100 * np.mean(v.difference):+.1f}{_mark(board, v)}{chance}"


def baseline_markdown(board: RetrievalBoard, task: str) -> str:
    """Each model against its family's baseline at every length: the mean difference (model - baseline, whole-answer
    points) over the seeds both have, ▲/▼ where resolved and meaningful (:meth:`RetrievalBoard.marked`), "(both
    at chance)" where neither is above it; no cells where either did not learn the task, and which did not."""
    labels = {e.name: e.label for e in board.entrants}
    lines = ["| model | − family baseline | " + " | ".join(f"L={n}" for n in board.lengths) + " | not compared |",
             "|" + "---|" * (len(board.lengths) + 3)]
    for e in board.entrants:
        baseline = board.baseline_of(e)
        if baseline is None:
            continue
        unlearned = [labels[m] for m in (e.name, baseline) if not board.learned(m, task)]
        cells = [""] * len(board.lengths) if unlearned else \
            [_baseline_cell(board, board.against(e.name, task, n, baseline)) for n in board.lengths]
        note = f"{' and '.join(unlearned)} not learned at L={board.train_length}" if unlearned else ""
        lines.append(f"| {e.label} | {labels[baseline]} | " + " | ".join(cells) + f" | {note} |")
    return "\n".join(lines)


def seed_markdown(board: RetrievalBoard, task: str, length: int, labels: Dict[str, str]) -> str:
    """Each model's difference to each of its references at ``length``, seed by seed, in whole-answer points, with
    its interval."""
    lines = ["| model | − reference | seeds | difference (points) | intervals | verdict |", "|---|---|---|---|---|---|"]
    for v in (v for v in board.versus if v.protocol == task and v.length == length):
        lines.append(f"| {labels[v.model]} | {labels[v.reference]} | {', '.join(map(str, v.seeds))} | "
                     + ", ".join(f"{100 * d:+.1f}" for d in v.difference) + " | "
                     + ", ".join(f"[{100 * lo:+.1f}, {100 * hi:+.1f}]" for lo, hi in v.interval)
                     + f" | {comparison_state(board, v)} |")
    return "\n".join(lines)


def csv_rows(board: RetrievalBoard) -> Tuple[List[str], List[list]]:
    header = ["model", "label", "family", "task", "length", "mean", "sd", "seeds", "accuracy_by_seed",
              "per_token_mean", "per_token_by_seed", "learned", "at_chance", "chance_in_context", "chance_uniform",
              "rank", "reference", "compared_seeds", "difference_by_seed", "interval_by_seed", "verdict", "units"]
    rows = []
    for task in board.tasks:
        ranks = board.ranks(task)
        for e in board.entrants:
            for n in board.lengths:
                chance = board.chance[task, n]["whole"]
                common = [e.name, e.label, e.family, task, n, board.mean(e.name, task, n), board.sd(e.name, task, n),
                          ";".join(map(str, e.seeds)), ";".join(map(str, board.accuracy[e.name, task, n])),
                          float(np.mean(board.per_token[e.name, task, n])),
                          ";".join(map(str, board.per_token[e.name, task, n])), board.learned(e.name, task),
                          board.at_chance(e.name, task, n), chance["in_context"], chance["uniform"],
                          ranks.get(e.name, "")]
                found = [v for v in board.versus if (v.model, v.protocol, v.length) == (e.name, task, n)]
                rows += [common + [v.reference, ";".join(map(str, v.seeds)), ";".join(map(str, v.difference)),
                                   ";".join(f"{lo} {hi}" for lo, hi in v.interval), comparison_state(board, v),
                                   v.units] for v in found] or [common + [""] * 6]
    return header, rows


def band_names(bands: int) -> List[str]:
    """Depth bands as shares of where a needle can be: ``0-20%`` (the start of the input) .. ``80-100%``."""
    return [f"{100 * k // bands}-{100 * (k + 1) // bands}%" for k in range(bands)]


@dataclass
class DepthMap:
    """A task's whole-answer accuracy by length and the depth band of its needle (kerple-eval-lm's records with
    ``--depth-bands``), by model (in ``entrants``' order) and seed."""

    task: str
    lengths: List[int]
    bands: int
    accuracy: Dict[str, np.ndarray]  # model: seeds x lengths x bands, whole-answer accuracy in [0, 1]
    counts: np.ndarray  # every run's whole answers in each cell, lengths x bands (the same examples for every run)

    @classmethod
    def of(cls, task: str, entrants: Sequence[Entrant], records: Dict[Run, List[dict]]) -> "DepthMap":
        found = {run: {r["length"]: r["depth_bands"] for r in rs if r["task"] == task} for run, rs in records.items()}
        lengths = sorted(next(iter(found.values())))
        bands = len(next(iter(found.values()))[lengths[0]])
        alike = all(sorted(by_length) == lengths and all([b["band"] for b in by_length[n]] == list(range(bands))
                                                          for n in lengths) for by_length in found.values())
        counts = {tuple(tuple(b["num_whole"] for b in by_length[n]) for n in lengths)
                  for by_length in found.values()} if alike else set()
        if len(counts) != 1:
            raise UsageError(f"the depth maps of {task} were made with other lengths, bands or examples: make them "
                             "again with the same options")
        accuracy = {e.name: np.array([[[b["whole_accuracy"] for b in found[e.name, seed][n]] for n in lengths]
                                      for seed in e.seeds], dtype=np.float64) for e in entrants}
        return cls(task, lengths, bands, accuracy, np.array(counts.pop()))

    def widest_interval(self) -> float:
        """The half-width (points) of the widest normal 95% interval of a cell's accuracy, a seed alone: that
        of an accuracy of one half over the smallest cell."""
        return 100 * 1.96 * 0.5 / math.sqrt(int(self.counts.min()))


def depth_map_markdown(depth_map: DepthMap, entrants: Sequence[Entrant]) -> str:
    """A table per model: its whole-answer accuracy (%, mean over its seeds) at each length (rows) with the
    needle in each depth band (columns); nothing pooled over lengths."""
    names = band_names(depth_map.bands)
    text = []
    for e in entrants:
        mean = depth_map.accuracy[e.name].mean(axis=0)
        text += [f"**{e.label}**", "", "| length | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 1)]
        text += [f"| {n} | " + " | ".join(f"{100 * a:.0f}" for a in row) + " |" for n, row in zip(depth_map.lengths, mean)]
        text.append("")
    return "\n".join(text).rstrip("\n")
