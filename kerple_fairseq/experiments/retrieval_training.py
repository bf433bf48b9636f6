"""Training a model of the retrieval comparison until it has learned the tasks: ``fairseq-train`` in stretches
of ``--check-every`` updates, each followed by a check of its whole-answer accuracy at the training length on
held-out examples (the test split: the board's validation examples play no part in when it stops), and a
stop at the first check where every task reaches ``--criterion``, or at ``--updates`` updates (the cap). A
model stopped by the cap is recorded as not learned, with its accuracy at its last check.

Each check is recorded as it ends (``checks.json``: the training's key, the checks so far, the digest of the
checkpoint they read): the same command after an interruption resumes fairseq-train from that checkpoint,
which holds the optimiser, the schedule and the place in the epoch; anything else in the run's directory
is started again. The finished training's record (``trained.json``) holds every check and whether the
criterion was met."""

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

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


def resumed_checks(step: Step) -> List[dict]:
    """The checks of the training under way in ``step``'s directory, if they are this training's and its
    checkpoint is the one they read; else nothing (the directory is cleared, to start again)."""
    save_dir, checkpoint = step.record.parent, step.outputs[0]
    try:
        progress = json.loads((save_dir / CHECKS).read_text())
        if progress["key"] == json.loads(json.dumps(step.key)) and checkpoint.is_file() \
                and progress["checkpoint"] == file_digest(checkpoint):
            return list(progress["checks"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return []


def record_checks(step: Step, checks: List[dict], seconds: float) -> None:
    path = step.record.parent / CHECKS
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps({"key": step.key, "checks": checks, "seconds": seconds,
                                   "checkpoint": file_digest(step.outputs[0])}, indent=1))
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
    checks = resumed_checks(step)
    spent = json.loads((save_dir / CHECKS).read_text())["seconds"] if checks else 0.0
    if checks:
        stage(f"{save_dir.name}: resuming after {checks[-1]['updates']} updates")
    else:
        shutil.rmtree(save_dir, ignore_errors=True)
        shutil.rmtree(args.out / "tensorboard" / save_dir.name, ignore_errors=True)
        save_dir.mkdir(parents=True)
    flags, cap = step.key["fairseq-train"], int(step.key["fairseq-train"][-1])
    log = save_dir / "train.log"
    while not checks or not (learned(checks[-1], args.criterion) or checks[-1]["updates"] >= cap):
        done = checks[-1]["updates"] if checks else 0
        target = min(done + args.check_every, cap)
        stage(f"training {name}, seed {seed}: updates {done} to {target} of at most {cap}")
        run([BIN / "fairseq-train", "--user-dir", USER_DIR, *stretch_flags(flags, target), "--save-dir", save_dir,
             "--tensorboard-logdir", args.out / "tensorboard" / save_dir.name], log=save_dir / f"train-{target}.log")
        with open(log, "a") as whole:
            whole.write((save_dir / f"train-{target}.log").read_text())
        (save_dir / f"train-{target}.log").unlink()
        checks.append(check(args, task_flags, checkpoint, target))
        accuracies = ", ".join(f"{task} {100 * a:.1f}%" for task, a in checked_accuracy(checks[-1]).items())
        stage(f"{name}, seed {seed}, after {target} updates: whole answers at L={args.train_length}: {accuracies}")
        record_checks(step, checks, spent + time.time() - started)
    reached = learned(checks[-1], args.criterion)
    stage(f"{name}, seed {seed}: " + (f"learned the tasks in {checks[-1]['updates']} updates" if reached else
                                      f"not learned in {cap} updates (the cap)"))
    seconds = spent + time.time() - started
    step.complete(seconds, checks=checks, learned=reached, updates=checks[-1]["updates"],
                  losses=last_losses(log.read_text()))
    (save_dir / CHECKS).unlink()
    return checkpoint, seconds
