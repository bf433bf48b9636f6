"""What a comparison's runs will cost before they run, and which seeds fit a budget of hours.

The estimate starts from one model's runs measured on this machine at this comparison's settings (the
first model's, or the first that trains a model of its own) and scales them, training and evaluation apart, by each model's cost relative to
that model in another comparison's records (the same models at another training length, where there
is one; otherwise every model costs what the measured one did). A model evaluated on another's
checkpoint (a rotary scaling) costs no training wherever it cost none there. A model already run at
these settings costs what its runs took: a cost that grows faster with the length than the measured
model's (FIRE's and DAPE's functions of every query-key pair, PaTH's) is then its own.

Over a budget, the seeds go first to the models whose order is in question and to the references
they are compared against; the others keep their first seed. Runs already finished always count, so
that the same command with a larger budget (or none) adds seeds and drops nothing.
"""

import json
import statistics
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from kerple_fairseq.experiments.comparison import EVALUATION_RECORD

RECORDS = ("trained.json", EVALUATION_RECORD)
#: the record of a further evaluation some comparisons make (the retrieval comparison's depth map), counted
#: with the evaluation where a run has it
FURTHER_EVALUATION = "mapped.json"

Run = Tuple[str, int]  # a model's name and its seed
Seconds = Tuple[float, float]  # training, evaluation


def recorded_seconds(run_dir: Path) -> Optional[Seconds]:
    """The seconds a finished run's training and evaluation took by its records, or None."""
    try:
        training, evaluation = (float(json.loads((run_dir / record).read_text())["seconds"]) for record in RECORDS)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        evaluation += float(json.loads((run_dir / FURTHER_EVALUATION).read_text())["seconds"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return training, evaluation


def run_dirs(comparison: Path) -> Dict[Run, Path]:
    """A comparison's run directories, ``<model>-seed<S>``, by model and seed."""
    runs = {}
    for path in comparison.glob("*-seed*"):
        name, _, seed = path.name.rpartition("-seed")
        if path.is_dir() and seed.isdigit():
            runs[name, int(seed)] = path
    return runs


def model_costs(comparison: Path, seconds_of: Callable[[Run, Path], Optional[Seconds]] = lambda run, path: recorded_seconds(path)
                ) -> Dict[str, Seconds]:
    """Each model's mean seconds of training and of evaluation over its finished runs in ``comparison``, as
    ``seconds_of`` gives them for a run and its directory (None for one unfinished; by default, the records'
    seconds where it has a record of each)."""
    by_model: Dict[str, List[Seconds]] = {}
    for (name, seed), path in run_dirs(comparison).items():
        seconds = seconds_of((name, seed), path)
        if seconds is not None:
            by_model.setdefault(name, []).append(seconds)
    return {name: (statistics.mean(t for t, _ in s), statistics.mean(e for _, e in s)) for name, s in by_model.items()}


def measured_model(names: Sequence[str], here: Dict[str, Seconds], trains: Callable[[str], bool]) -> str:
    """The model to scale the others' estimates from: the first of ``names`` measured ``here`` that ``trains`` a
    model of its own (one evaluated on another's checkpoint records next to no training, and would price every
    training at nothing), else the first measured."""
    measured = [name for name in names if name in here]
    return next((name for name in measured if trains(name)), measured[0])


def estimate(runs: Sequence[Run], measured: str, here: Dict[str, Seconds], relative: Dict[str, Seconds]) -> Dict[Run, float]:
    """Each of ``runs`` in seconds: its model's mean training and evaluation seconds ``here`` where it has
    them; otherwise the ``measured`` model's here, each times the model's cost over the measured model's in
    ``relative`` (a factor of one where either lacks it)."""
    base, seconds = relative.get(measured), here[measured]

    def factor(name: str, part: int) -> float:
        if base is None or name not in relative or base[part] <= 0:
            return 1.0
        return relative[name][part] / base[part]

    return {run: sum(here[run[0]]) if run[0] in here else seconds[0] * factor(run[0], 0) + seconds[1] * factor(run[0], 1)
            for run in runs}


def best_at_longest(comparison: Path, protocol: str = "early-token-cursed") -> List[str]:
    """The models of a finished comparison, best first: lowest mean perplexity over their seeds at the
    longest length each was evaluated at under ``protocol``."""
    ppl: Dict[str, List[float]] = {}
    for (name, _), path in run_dirs(comparison).items():
        try:
            records = [r for r in json.loads((path / "eval.json").read_text()) if r["protocol"] == protocol]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if records:
            ppl.setdefault(name, []).append(max(records, key=lambda r: r["length"])["ppl"])
    return sorted(ppl, key=lambda name: statistics.mean(ppl[name]))


def seeds_within(budget_seconds: Optional[float], models: Sequence[str], seeds: Sequence[int],
                 in_question: Sequence[str], cost: Dict[Run, float], finished: Sequence[Run]) -> Dict[str, List[int]]:
    """The seeds each model runs with: all of ``seeds`` where the unfinished runs' ``cost`` stays within
    ``budget_seconds`` (or there is no budget); otherwise every seed of the models ``in_question``, the
    first of the others, and every run already ``finished``."""
    every = {name: list(seeds) for name in models}
    left = sum(cost[name, seed] for name in models for seed in seeds if (name, seed) not in finished)
    if budget_seconds is None or left <= budget_seconds:
        return every
    return {name: [s for s in seeds if name in in_question or s == seeds[0] or (name, s) in finished] for name in models}
