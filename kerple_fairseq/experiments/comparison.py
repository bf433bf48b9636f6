"""Comparing language models: each is trained, then evaluated by kerple-eval-lm under the
early-token-cursed and last-token protocols at several lengths, and the perplexities are tabulated
in markdown. The small CPU comparison and the reproduction of KERPLE's Table 10 both run this."""

import json
import sys
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Callable, Dict, Hashable, List, NamedTuple, Optional, Sequence, Tuple

from kerple_fairseq.experiments.finished_steps import Step, data_bin_fingerprint, file_digest
from kerple_fairseq.experiments.paths import SCRIPTS

PROTOCOLS = ("early-token-cursed", "last-token")  # also how kerple-eval-lm's result lines begin
FILES_WRITTEN = ("--results-json", "--per-token", "--position-wise")  # kerple-eval-lm options naming an output
EVALUATION_RECORD = "evaluated.json"  # beside the checkpoint evaluated


class CommandFailed(Exception):
    """A command of the pipeline exited with a non-zero status."""

    def __init__(self, program: str, returncode: int):
        super().__init__(f"{program} exited with {returncode}")
        self.returncode = returncode


class Model(NamedTuple):
    """One model of a comparison."""

    key: Hashable  # how the results name it
    train: Callable[[], Tuple[Path, float]]  # trains it (or finds it trained): its checkpoint, the seconds spent now
    eval_flags: Sequence = ()  # more kerple-eval-lm options for it
    training: Optional[Step] = None  # its training's record, key and checkpoint, where it keeps one


class Evaluated(NamedTuple):
    checkpoint: Path
    records: List[dict]  # kerple-eval-lm's --results-json: protocol, length, ppl, ...


@dataclass(frozen=True)
class Comparison:
    """The models' common evaluation: ``data_bin``'s validation split at ``lengths``, the last-token
    protocol on ``num_targets`` targets, ``device_flags`` (``--cpu`` or ``--fp16``), each command
    run by ``run`` (which raises :class:`CommandFailed`), ``announce(model)`` said before each
    evaluation that runs, and ``log`` told of skipped steps and progress.

    ``kept`` names the files of a run's directory that stand for its evaluation, with its results
    and records, once its checkpoint and per-token file are gone; ``keep(run directory)`` writes them
    at the end of each evaluation, whose outputs they are. A run carried with only these (committed,
    or copied to another machine) is ranked and tabulated again without training, as long as its
    training record has the model's options and its evaluation record the comparison's."""

    data_bin: Path
    lengths: Sequence[int]
    num_targets: int
    device_flags: Sequence[str]
    run: Callable[[list], None]
    announce: Callable[[Model], None] = lambda model: None
    log: Callable[[str], None] = lambda line: None
    kept: Sequence[str] = ()
    keep: Callable[[Path], None] = lambda run_dir: None

    @cached_property
    def data_fingerprint(self) -> str:
        return data_bin_fingerprint(Path(self.data_bin))

    def evaluation(self, model: Model, checkpoint: Path) -> Tuple[Step, List, Path]:
        """The evaluation of ``checkpoint``: its step (recorded in ``evaluated.json`` beside it; by the same
        options, on the same data; paths compared by name within the run's directory, so that a moved
        checkout or output directory keeps its evaluations), the kerple-eval-lm options, the results file."""
        results = checkpoint.parent / "eval.json"
        options = [self.data_bin, "--path", checkpoint, "--gen-subset", "valid", "--protocol", "all",
                   "--lengths", *self.lengths, "--num-targets", self.num_targets, "--max-tokens", 16384,
                   "--results-json", results, *self.device_flags, *model.eval_flags]

        def portable(option) -> str:
            if isinstance(option, Path) and option.parent == checkpoint.parent:
                return option.name
            return "<data-bin>" if option == self.data_bin else str(option)

        step = Step(checkpoint.parent / EVALUATION_RECORD,
                    {"kerple-eval-lm": [portable(o) for o in options], "data": self.data_fingerprint,
                     "checkpoint": file_digest(checkpoint) if checkpoint.is_file() else None},
                    [*(Path(str(options[k + 1])) for k, o in enumerate(options) if o in FILES_WRITTEN),
                     *(checkpoint.parent / name for name in self.kept)])
        return step, options, results

    def kept_evaluation(self, model: Model) -> Optional[List[dict]]:
        """The records of a run kept without its checkpoint (see the class), or None. Its evaluation read
        the checkpoint its training wrote: a training clears its run's directory before it starts."""
        training = model.training
        if not self.kept or training is None or training.outputs[0].is_file():
            return None
        if Step(training.record, training.key, []).finished() is None:
            return None
        step, _, results = self.evaluation(model, training.outputs[0])
        run_dir = training.record.parent
        kept = Step(step.record, step.key, [results, *(run_dir / name for name in self.kept)])
        if kept.finished(unchecked=("checkpoint",)) is None:
            return None
        self.log(f"{run_dir.name} is kept without its checkpoint, trained and evaluated so: reading {results}")
        return json.loads(results.read_text())

    @staticmethod
    def evaluation_recorded(model: Model) -> bool:
        """Whether the run of ``model`` holds a record of an evaluation, whatever its key (for the estimate of
        the time left only: whether the step is finished is checked when it is reached)."""
        return model.training is not None and (model.training.outputs[0].parent / EVALUATION_RECORD).is_file()

    def evaluate(self, model: Model, checkpoint: Path) -> Tuple[List[dict], float]:
        """kerple-eval-lm's records of every protocol at every length (also in ``eval.json`` beside the
        checkpoint), and the seconds spent now: none when this checkpoint was evaluated so before."""
        step, options, results = self.evaluation(model, checkpoint)
        if step.finished() is not None:
            self.log(f"{checkpoint.parent.name} is evaluated so already: reading {results}")
            return json.loads(results.read_text()), 0.0
        self.announce(model)
        step.forget()
        started = time.time()
        self.run([sys.executable, SCRIPTS / "eval_lm.py", *options])
        self.keep(checkpoint.parent)
        seconds = time.time() - started
        step.complete(seconds)
        return json.loads(results.read_text()), seconds

    def train_and_evaluate(self, models: Sequence[Model],
                           plan: Callable[[List[Model]], List[Model]] = list) -> Dict[Hashable, Evaluated]:
        """Each model in turn trained, then evaluated (each step skipped where it finished before, both
        where the run is kept without its checkpoint); by its key. Once the first is done, ``plan(models)``
        gives those to make, the first still first (what its cost leaves of them). After each, how many
        are done and an estimate of the time left: the mean time of the models that needed work so far,
        times the models left whose run holds no record of an evaluation (a run with one is most likely
        finished, and costs no time)."""
        evaluated, worked, spent = {}, 0, 0.0
        models, done = list(models), 0
        while done < len(models):
            model = models[done]
            records = self.kept_evaluation(model)
            if records is not None:
                checkpoint, training, evaluation = model.training.outputs[0], 0.0, 0.0
            else:
                checkpoint, training = model.train()
                records, evaluation = self.evaluate(model, checkpoint)
            evaluated[model.key] = Evaluated(checkpoint, records)
            done += 1
            if done == 1:
                models = plan(models)
            if training + evaluation > 0:
                worked, spent = worked + 1, spent + training + evaluation
            left = sum(not self.evaluation_recorded(m) for m in models[done:])
            estimate = f"; about {spent / worked * left / 60:.0f} min left" if worked and left else ""
            self.log(f"{done} of {len(models)} models trained and evaluated{estimate}")
        return evaluated


def protocol_rows(cells: List[str], records: List[dict]) -> List[Tuple[List[str], Dict[int, float]]]:
    """A model's table rows: its ``cells``, then each protocol and its perplexity by length."""
    return [(cells + [protocol], {r["length"]: r["ppl"] for r in records if r["protocol"] == protocol})
            for protocol in PROTOCOLS]


def markdown_table(columns: List[str], rows: List[Tuple[List[str], Dict[int, float]]], lengths: Sequence[int]) -> str:
    """``columns`` then a column per length; each row its cells then its perplexities (blank where none)."""
    lines = ["| " + " | ".join(columns + [f"L={n}" for n in lengths]) + " |",
             "|" + "---|" * (len(columns) + len(lengths))]
    for cells, ppl in rows:
        lines.append("| " + " | ".join(cells + [f"{ppl[n]:.2f}" if n in ppl else "" for n in lengths]) + " |")
    return "\n".join(lines)
