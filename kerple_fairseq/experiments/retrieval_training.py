"""Training a model of the retrieval comparison until it has learned the tasks: ``fairseq-train`` in stretches
of ``--check-every`` updates, each followed by a check of its whole-answer accuracy at the training length on
held-out examples (the test split: the board's validation examples play no part in when it stops), and a
stop at the first check where every task reaches ``--criterion``, or at ``--updates`` updates (the cap). A
model stopped by the cap is recorded as not learned, with its accuracy at its last check.

Each check is recorded as it ends (``checks.json``: the training's key, the checks so far, the digest of the
checkpoint they read): the same command after an interruption resumes fairseq-train from that checkpoint,
which holds the optimiser, the schedule and the place in the epoch. A stretch that had saved its checkpoint
when the interruption came (during its check) is kept: its checkpoint is checked, then the training goes on.
Anything else in the run's directory is started again, saying why. The finished training's record
(``trained.json``) holds every check and whether the criterion was met."""

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Tuple

from kerple_fairseq.errors import UsageError
from kerple_fairseq.evaluation.checkpoint_file import read_checkpoint
from kerple_fairseq.experiments.finished_steps import Step, file_digest
from kerple_fairseq.experiments.paths import BIN, SCRIPTS, USER_DIR
from kerple_fairseq.experiments.small_comparison import last_losses, run, stage, trained_alike

CHECKS = "checks.json"  # the checks so far of a training under way
CHECK_RESULTS = "check.json"  # the last check's kerple-eval-lm records


def checked_accuracy(check: dict) -> Dict[str, float]:
    return check["whole_accuracy"]


def learned(check: dict, criterion: float) -> bool:
    """Whether every task reached ``criterion`` (whole answers, at the training length) at ``check``."""
    return all(accuracy >= criterion for accuracy in checked_accuracy(check).values())


def stretch_flags(flags: List[str], updates: int) -> List[str]:
    """fairseq-train's ``flags`` (the whole training's, ending with ``--max-update`` and the cap) stopping at
    ``updates`` instead."""
    assert flags[-2] == "--max-update", flags[-2:]
    return [*flags[:-1], str(updates)]


def checkpoint_updates(checkpoint: Path) -> Optional[int]:
    """The updates fairseq-train had made when it wrote ``checkpoint`` (read as data); None where it cannot say."""
    try:
        return int(read_checkpoint(str(checkpoint))["optimizer_history"][-1]["num_updates"])
    except (UsageError, LookupError, TypeError, ValueError):
        return None


class Progress(NamedTuple):
    """A training under way: its checks so far, the updates of a checkpoint saved after the last of them but not
    yet checked (a stretch interrupted during its check), the seconds spent, and, where there is nothing to
    resume, why it starts again (empty where nothing was under way)."""

    checks: List[dict]
    unchecked: Optional[int] = None
    seconds: float = 0.0
    why_again: str = ""

    @property
    def resumed(self) -> bool:
        return bool(self.checks) or self.unchecked is not None


def resumed_checks(step: Step, cap: int) -> Progress:
    """The training under way in ``step``'s directory, capped at ``cap`` updates. A checkpoint that is neither the
    one its checks read nor a later stretch's of this training is not resumed."""
    save_dir, checkpoint = step.record.parent, step.outputs[0]
    try:
        progress = json.loads((save_dir / CHECKS).read_text())
        key, checks, digest = progress["key"], list(progress["checks"]), progress["checkpoint"]
        seconds, done = float(progress["seconds"]), checks[-1]["updates"] if checks else 0
    except (OSError, ValueError, KeyError, TypeError):
        return Progress([], why_again="no check of it was recorded" if checkpoint.is_file() else "")
    if key != json.loads(json.dumps(step.key)):
        return Progress([], why_again="it was made with other options")
    if not checkpoint.is_file():
        return Progress([], why_again=f"its {checkpoint.name} is gone" if checks
                        else "it was cut short before its first check")
    if digest == file_digest(checkpoint):
        return Progress(checks, None, seconds)
    updates = checkpoint_updates(checkpoint)
    if updates is not None and done < updates <= cap:
        return Progress(checks, updates, seconds)
    return Progress([], why_again=f"its {checkpoint.name} is not the one its checks read, nor a later one of this "
                                  "training")


def record_checks(step: Step, checks: List[dict], seconds: float) -> None:
    """``checks.json``: the training's key, its checks so far, the seconds spent and the digest of the checkpoint
    the last check read (none before the first)."""
    path = step.record.parent / CHECKS
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps({"key": step.key, "checks": checks, "seconds": seconds,
                                   "checkpoint": file_digest(step.outputs[0]) if checks else None}, indent=1))
    os.replace(partial, path)


def check(args: argparse.Namespace, task_flags: List[str], checkpoint: Path, updates: int) -> dict:
    """The whole-answer and per-token accuracy of each task at the training length, on ``--check-examples``
    test examples of each."""
    results = checkpoint.parent / CHECK_RESULTS
    run([sys.executable, SCRIPTS / "eval_lm.py", *task_flags, "--valid-examples", args.check_examples, "--path",
         checkpoint, "--gen-subset", "test", "--lengths", args.train_length, "--max-tokens", 16384, "--cpu",
         "--no-progress-bar", "--results-json", results], show=lambda line: False)
    records = json.loads(results.read_text())
    return {"updates": updates, "whole_accuracy": {r["task"]: r["whole_accuracy"] for r in records},
            "accuracy": {r["task"]: r["accuracy"] for r in records}}


def train_to_criterion(args: argparse.Namespace, step: Step, task_flags: List[str], name: str,
                       seed: int) -> Tuple[Path, float]:
    """The training ``step`` of model ``name`` with ``seed`` (its key: the whole training's fairseq-train
    options, the cap last, and the rule of the checks), resumed or started; its checkpoint and the seconds
    spent now. A model trained as another finished run in ``--out`` was gets a copy of that one's checkpoint
    and checks."""
    save_dir, checkpoint = step.record.parent, step.outputs[0]
    if step.finished() is not None:
        stage(f"{save_dir.name} is trained so already: keeping {checkpoint}")
        return checkpoint, 0.0
    started = time.time()
    same = trained_alike(args, step, seed)
    if same is not None:
        stage(f"{name} is trained as {same.parent.name} is: evaluating a copy of its checkpoint")
        shutil.rmtree(save_dir, ignore_errors=True)
        save_dir.mkdir(parents=True)
        shutil.copyfile(same, checkpoint)
        facts = json.loads((same.parent / step.record.name).read_text())
        step.complete(time.time() - started, **{k: facts[k] for k in ("checks", "learned", "updates", "losses")})
        return checkpoint, time.time() - started
    flags, cap = step.key["fairseq-train"], int(step.key["fairseq-train"][-1])
    progress = resumed_checks(step, cap)
    checks, unchecked, spent = progress.checks, progress.unchecked, progress.seconds
    if progress.resumed:
        stage(f"{save_dir.name}: resuming after {unchecked or checks[-1]['updates']} updates"
              + (", checking first the checkpoint its last stretch saved" if unchecked else ""))
    else:
        if progress.why_again:
            stage(f"{save_dir.name}: starting its training again: {progress.why_again}")
        shutil.rmtree(save_dir, ignore_errors=True)
        shutil.rmtree(args.out / "tensorboard" / save_dir.name, ignore_errors=True)
        save_dir.mkdir(parents=True)
        record_checks(step, checks, spent)
    log = save_dir / "train.log"

    def check_stretch(target: int) -> None:
        """The check of the checkpoint saved after ``target`` updates, its stretch's log kept, recorded."""
        stretch_log = save_dir / f"train-{target}.log"
        if stretch_log.is_file():
            with open(log, "a") as whole:
                whole.write(stretch_log.read_text())
            stretch_log.unlink()
        checks.append(check(args, task_flags, checkpoint, target))
        accuracies = ", ".join(f"{task} {100 * a:.1f}%" for task, a in checked_accuracy(checks[-1]).items())
        stage(f"{name}, seed {seed}, after {target} updates: whole answers at L={args.train_length}: {accuracies}")
        record_checks(step, checks, spent + time.time() - started)

    if unchecked:
        check_stretch(unchecked)
    while not checks or not (learned(checks[-1], args.criterion) or checks[-1]["updates"] >= cap):
        done = checks[-1]["updates"] if checks else 0
        target = min(done + args.check_every, cap)
        stage(f"training {name}, seed {seed}: updates {done} to {target} of at most {cap}")
        run([BIN / "fairseq-train", "--user-dir", USER_DIR, *stretch_flags(flags, target), "--save-dir", save_dir,
             "--tensorboard-logdir", args.out / "tensorboard" / save_dir.name], log=save_dir / f"train-{target}.log")
        check_stretch(target)
    reached = learned(checks[-1], args.criterion)
    stage(f"{name}, seed {seed}: " + (f"learned the tasks in {checks[-1]['updates']} updates" if reached else
                                      f"not learned in {cap} updates (the cap)"))
    seconds = spent + time.time() - started
    step.complete(seconds, checks=checks, learned=reached, updates=checks[-1]["updates"],
                  losses=last_losses(log.read_text()))
    (save_dir / CHECKS).unlink()
    return checkpoint, seconds
