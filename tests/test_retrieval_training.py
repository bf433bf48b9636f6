"""Training to the criterion (:mod:`kerple_fairseq.experiments.retrieval_training`), its commands replaced by
stand-ins with scripted outcomes: it stops at the first check where every task reaches the criterion or at the
cap, records every check, resumes an interrupted training from its last check (checking first a checkpoint saved
by a stretch interrupted during its check), and starts again, saying why, when the checkpoint is neither the one
its checks read nor a later one of the training. (``tests/test_retrieval_commands.py`` runs the real commands.)"""

import argparse
import json

import pytest

from kerple_fairseq.experiments import retrieval_training
from kerple_fairseq.experiments.finished_steps import Step

TASKS = ("mqar", "passkey", "copy")


class Interrupted(Exception):
    pass


class StandIns:
    """fairseq-train writing a checkpoint that names its updates, and checks giving ``accuracy(updates)``."""

    def __init__(self, accuracy, interrupt_at=None, interrupt_check_at=None, interrupt_saved_at=None):
        self.accuracy, self.interrupt_at, self.interrupt_check_at = accuracy, interrupt_at, interrupt_check_at
        self.interrupt_saved_at, self.trained, self.checked = interrupt_saved_at, [], []

    def run(self, cmd, log=None, show=None):
        cmd = [str(c) for c in cmd]
        target = int(cmd[cmd.index("--max-update") + 1])
        if target == self.interrupt_at:
            self.interrupt_at = None
            raise Interrupted()
        save_dir = cmd[cmd.index("--save-dir") + 1]
        with open(f"{save_dir}/checkpoint_last.pt", "w") as f:
            f.write(f"trained to {target}")
        log.write_text(f"| train_inner | epoch 001:  {target} / 99 loss=1.5, num_updates={target}\n")
        self.trained.append(target)
        if target == self.interrupt_saved_at:  # its checkpoint and log written, fairseq-train not yet ended
            self.interrupt_saved_at = None
            raise Interrupted()

    def check(self, args, task_flags, checkpoint, updates):
        assert checkpoint.read_text() == f"trained to {updates}"
        if updates == self.interrupt_check_at:
            self.interrupt_check_at = None
            raise Interrupted()
        self.checked.append(updates)
        return {"updates": updates, "whole_accuracy": dict(zip(TASKS, self.accuracy(updates))),
                "accuracy": dict(zip(TASKS, self.accuracy(updates)))}


def updates_named(checkpoint):
    """The updates a stand-in checkpoint names, as :func:`retrieval_training.checkpoint_updates` reads a real one's
    (tested in ``tests/test_retrieval_commands.py``)."""
    text = checkpoint.read_text()
    return int(text.split()[-1]) if text.startswith("trained to ") else None


def training(tmp_path, monkeypatch, stand_ins, cap=40, criterion=0.97):
    monkeypatch.setattr(retrieval_training, "run", stand_ins.run)
    monkeypatch.setattr(retrieval_training, "check", stand_ins.check)
    monkeypatch.setattr(retrieval_training, "checkpoint_updates", updates_named)
    said = []
    monkeypatch.setattr(retrieval_training, "stage", said.append)
    stand_ins.said = said
    args = argparse.Namespace(out=tmp_path, check_every=4, criterion=criterion, train_length=64)
    save_dir = tmp_path / "alibi-seed1"
    step = Step(save_dir / "trained.json", {"fairseq-train": ["--arch", "x", "--max-update", str(cap)],
                                            "checks": {"criterion": criterion}}, [save_dir / "checkpoint_last.pt"])
    return step, lambda: retrieval_training.train_to_criterion(args, step, [], "alibi", 1)


def by_updates(table):
    return lambda updates: table[updates]


def test_it_stops_at_the_first_check_every_task_passes(tmp_path, monkeypatch):
    stand_ins = StandIns(by_updates({4: (0.5, 0.2, 0.1), 8: (0.99, 0.96, 1.0), 12: (0.97, 0.98, 1.0)}))
    step, train = training(tmp_path, monkeypatch, stand_ins)
    checkpoint, _ = train()
    assert stand_ins.trained == [4, 8, 12] and checkpoint.read_text() == "trained to 12"
    record = json.loads(step.record.read_text())
    assert record["learned"] is True and record["updates"] == 12 and [c["updates"] for c in record["checks"]] == [4, 8, 12]
    assert record["losses"]["train_inner"] == {"loss": 1.5, "num_updates": 12}
    assert not (step.record.parent / retrieval_training.CHECKS).exists()
    assert train()[1] == 0.0 and stand_ins.trained == [4, 8, 12]  # finished: kept


def test_a_model_that_never_passes_stops_at_the_cap_as_not_learned(tmp_path, monkeypatch):
    stand_ins = StandIns(lambda updates: (1.0, 1.0, 0.5))
    step, train = training(tmp_path, monkeypatch, stand_ins, cap=10)
    train()
    assert stand_ins.trained == [4, 8, 10]
    record = json.loads(step.record.read_text())
    assert record["learned"] is False and record["updates"] == 10 and record["checks"][-1]["whole_accuracy"]["copy"] == 0.5


def test_an_interrupted_training_resumes_from_its_last_check(tmp_path, monkeypatch):
    stand_ins = StandIns(lambda updates: (1.0, 1.0, 1.0 if updates >= 16 else 0.0), interrupt_at=12)
    step, train = training(tmp_path, monkeypatch, stand_ins)
    with pytest.raises(Interrupted):
        train()
    progress = json.loads((step.record.parent / retrieval_training.CHECKS).read_text())
    assert [c["updates"] for c in progress["checks"]] == [4, 8] and not step.record.exists()
    train()
    assert stand_ins.trained == [4, 8, 12, 16]
    assert [c["updates"] for c in json.loads(step.record.read_text())["checks"]] == [4, 8, 12, 16]


@pytest.mark.parametrize("interrupted", ["interrupt_check_at", "interrupt_saved_at"])
def test_a_stretch_interrupted_after_its_save_is_checked_not_trained_again(tmp_path, monkeypatch, interrupted):
    stand_ins = StandIns(lambda updates: (1.0, 1.0, 1.0 if updates >= 16 else 0.0), **{interrupted: 12})
    step, train = training(tmp_path, monkeypatch, stand_ins)
    with pytest.raises(Interrupted):
        train()
    assert stand_ins.trained == [4, 8, 12] and stand_ins.checked == [4, 8]
    train()
    assert stand_ins.trained == [4, 8, 12, 16] and stand_ins.checked == [4, 8, 12, 16]
    assert any("resuming after 12 updates, checking first" in line for line in stand_ins.said)
    record = json.loads(step.record.read_text())
    assert [c["updates"] for c in record["checks"]] == [4, 8, 12, 16]
    assert (step.record.parent / "train.log").read_text().count("num_updates=") == 4
    assert not list(step.record.parent.glob("train-*.log"))


def test_the_first_stretch_interrupted_during_its_check_is_kept(tmp_path, monkeypatch):
    stand_ins = StandIns(lambda updates: (1.0, 1.0, 1.0), interrupt_check_at=4)
    step, train = training(tmp_path, monkeypatch, stand_ins)
    with pytest.raises(Interrupted):
        train()
    train()
    assert stand_ins.trained == [4] and stand_ins.checked == [4]
    assert json.loads(step.record.read_text())["learned"] is True


@pytest.mark.parametrize("checkpoint_text, why", [
    ("trained elsewhere", "its checkpoint_last.pt is not the one its checks read, nor a later one of this training"),
    ("trained to 4", "its checkpoint_last.pt is not the one its checks read, nor a later one of this training"),  # older than the checks
    ("trained to 44", "its checkpoint_last.pt is not the one its checks read, nor a later one of this training"),  # beyond the cap
    (None, "its checkpoint_last.pt is gone"),
])
def test_a_checkpoint_its_checks_did_not_read_starts_the_training_again(tmp_path, monkeypatch, checkpoint_text, why):
    stand_ins = StandIns(lambda updates: (1.0, 1.0, 1.0 if updates >= 12 else 0.0), interrupt_at=12)
    step, train = training(tmp_path, monkeypatch, stand_ins)
    with pytest.raises(Interrupted):
        train()
    if checkpoint_text is None:
        step.outputs[0].unlink()
    else:
        step.outputs[0].write_text(checkpoint_text)
    train()
    assert stand_ins.trained == [4, 8, 4, 8, 12]
    assert [c["updates"] for c in json.loads(step.record.read_text())["checks"]] == [4, 8, 12]
    assert f"alibi-seed1: starting its training again: {why}" in stand_ins.said


def test_a_training_with_other_options_starts_again(tmp_path, monkeypatch):
    stand_ins = StandIns(lambda updates: (1.0, 1.0, 1.0 if updates >= 12 else 0.0), interrupt_at=12)
    step, train = training(tmp_path, monkeypatch, stand_ins)
    with pytest.raises(Interrupted):
        train()
    _, train_otherwise = training(tmp_path, monkeypatch, stand_ins, criterion=0.9)
    train_otherwise()
    assert stand_ins.trained == [4, 8, 4, 8, 12]
    assert "alibi-seed1: starting its training again: it was made with other options" in stand_ins.said
