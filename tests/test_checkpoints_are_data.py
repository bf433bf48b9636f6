"""A checkpoint is read as data: one carrying code (a pickled call of ``os.system``, or ``eval``), in any
place of its state, is refused by every plugin command that reads checkpoints, in one line, and the
code never runs; fairseq-train's own loading of it (``--restore-file``, as the training scripts
resume) refuses it as well. A checkpoint of the older layout (``args`` an ``argparse.Namespace``, NumPy
scalars among its metrics) loads and scores as the checkpoint it was made from."""

import argparse
import builtins
import os
import sys

import numpy as np
import pytest
import torch
from fairseq import options

from conftest import BIN, REPO, TRAIN_FLAGS, run, stock_eval_lm
from console_scripts import run_forked
from kerple_fairseq.analysis import cli as analysis_cli
from kerple_fairseq.errors import UsageError
from kerple_fairseq.evaluation import cli as evaluation_cli
from kerple_fairseq.evaluation.checkpoint_file import data_only_environment, read_checkpoint
from kerple_fairseq.evaluation.loading import load_language_model



class SystemCall:
    """Unpickling it runs a shell command that creates ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class Evaluation:
    """Unpickling it evaluates Python code that creates ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return builtins.eval, (f"open({self.marker!r}, 'w').close()",)


def with_payload(state, place, payload):
    """``state`` with ``payload`` put at ``place``."""
    if place == "cfg":
        state["cfg"] = payload
    elif place == "an option of cfg.model":
        state["cfg"]["model"]["bias_kernel"] = payload
    elif place == "args":
        state["args"] = argparse.Namespace(arch="transformer_lm_alibi", extra=payload)
    elif place == "a model weight":
        state["model"][next(iter(state["model"]))] = payload
    elif place == "metrics":
        state["extra_state"]["metrics"] = {"train": [payload]}
    elif place == "optimizer history":
        state["optimizer_history"].append({"payload": payload})
    elif place == "optimizer state":
        state["last_optimizer_state"] = {"state": {0: payload}}
    else:
        state[place] = (1, [payload])
    return state


PLACES = ["cfg", "an option of cfg.model", "args", "a model weight", "metrics", "optimizer history",
          "optimizer state", "a key of its own"]


@pytest.fixture
def payload_checkpoints(trained, tmp_path):
    """Copies of a trained checkpoint with a payload (each kind in turn) in each place, and the marker
    file the payload would create."""
    real = trained["alibi"][0] / "checkpoint_last.pt"
    marker = tmp_path / "payload-ran"
    paths = []
    for i, place in enumerate(PLACES):
        payload = (SystemCall, Evaluation)[i % 2](marker)
        path = tmp_path / f"payload-{i}.pt"
        torch.save(with_payload(torch.load(real, weights_only=True), place, payload), path)
        paths.append(path)
    return paths, marker


def plugin_commands(data_bin, path, out):
    """Every plugin command that reads a checkpoint: its console script and its arguments."""
    return {
        "kerple-eval-lm": ["kerple-eval-lm", data_bin, "--path", path, "--cpu", "--no-progress-bar"],
        "kerple-analyze kernels": ["kerple-analyze", "kernels", "--path", path, "--out", out],
        "kerple-analyze effective-length": ["kerple-analyze", "effective-length", "--path", path, "--out", out],
        "kerple-analyze position-wise": ["kerple-analyze", "position-wise", data_bin, "--path", path, "--length",
                                         "64", "--cpu", "--out", out],
        "kerple-analyze receptive-field": ["kerple-analyze", "receptive-field", data_bin, "--path", path, "--length",
                                           "64", "--cpu", "--out", out],
    }


ENTRY_POINTS = {"kerple-eval-lm": evaluation_cli.cli_main, "kerple-analyze": analysis_cli.cli_main}


def assert_refused(name, path, marker, returncode, stderr):
    lines = stderr.strip().splitlines()
    assert not marker.exists(), (name, path)
    assert returncode == 1 and "Traceback" not in stderr, (name, path, stderr[-3000:])
    prog = name.split()[0]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: refused to read checkpoint {path}: it "
                                                   "asks for the Python object "), (name, lines)


@pytest.mark.slow  # starts the commands
def test_no_plugin_command_runs_a_checkpoints_code(payload_checkpoints, data_bin, tmp_path, capfd, monkeypatch):
    """Each command's console script, as a process, on one of the checkpoints (a different place for each
    command); then every command on every checkpoint through the function its console script calls, its
    exit status and everything written to file descriptor 2 taken as the process's would be."""
    paths, marker = payload_checkpoints
    before = [path.read_bytes() for path in paths]
    out = tmp_path / "analysis"
    commands = {path: plugin_commands(data_bin, path, out) for path in paths}
    for i, name in enumerate(commands[paths[0]]):
        path = paths[(3 * i + 1) % len(paths)]
        cmd = commands[path][name]
        proc = run([BIN / cmd[0], *cmd[1:]], check=False)
        assert_refused(name, path, marker, proc.returncode, proc.stderr)
    for path in paths:
        for name, cmd in commands[path].items():
            monkeypatch.setattr(sys, "argv", [str(BIN / cmd[0])])
            with pytest.raises(SystemExit) as exited:
                ENTRY_POINTS[cmd[0]]([str(a) for a in cmd[1:]])
            assert_refused(name, path, marker, exited.value.code, capfd.readouterr().err)
    assert [path.read_bytes() for path in paths] == before
    assert not out.exists()


def test_the_library_refuses_before_building_anything(payload_checkpoints, data_bin, monkeypatch):
    """With every torch.load forced to unpickle freely (``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``), the plugin
    still reads weights-only."""
    paths, marker = payload_checkpoints
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    for path in paths:
        with pytest.raises(UsageError) as refused:
            load_language_model(str(path), str(data_bin))
        assert not marker.exists(), path
        message = str(refused.value)
        assert "\n" not in message and message.startswith(f"refused to read checkpoint {path}: it asks for the Python "
                                                          "object "), message


@pytest.mark.slow  # starts the commands
def test_fairseq_train_restoring_a_payload_checkpoint_runs_nothing(payload_checkpoints, data_bin, tmp_path,
                                                                   monkeypatch):
    """fairseq-train reads --restore-file with fairseq's own torch.load, which PyTorch makes weights-only
    unless TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD is set; then the file's code runs. The environment the
    plugin's scripts give fairseq-train forces weights-only loading even then, and the plugin reports
    the refusal in one line."""
    paths, marker = payload_checkpoints
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    restore = [BIN / "fairseq-train", data_bin, *TRAIN_FLAGS, "--arch", "transformer_lm_alibi", "--max-update", "1",
               "--restore-file", paths[3]]
    run([*restore, "--save-dir", tmp_path / "unprotected"], check=False)
    assert marker.exists(), "fairseq-train unpickles freely under TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1"
    marker.unlink()
    proc = run([*restore, "--save-dir", tmp_path / "resumed"], check=False, env=data_only_environment())
    assert not marker.exists()
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(errors) == 1 and f"refused to read checkpoint {paths[3]}: it asks for the Python object" in errors[0], errors


@pytest.mark.slow  # starts the commands
def test_model_overrides_are_a_literal_never_evaluated(trained, data_bin, tmp_path):
    marker = tmp_path / "override-ran"
    proc = run([BIN / "kerple-eval-lm", data_bin, "--path", trained["alibi"][0] / "checkpoint_last.pt", "--cpu",
                "--model-overrides", f"__import__('os').system('touch {marker}')"], check=False)
    lines = proc.stderr.strip().splitlines()
    assert not marker.exists() and proc.returncode == 1, proc.stderr[-3000:]
    assert len(lines) == 1 and "--model-overrides must be a Python dict literal" in lines[0], lines


# ------------------------------------------------------------------------------------ older layout

def legacy_checkpoint(trained, path):
    """A trained checkpoint rewritten as fairseq before Hydra and ALiBi's fork wrote theirs: its options
    in ``args`` (an ``argparse.Namespace``), no ``cfg``, and NumPy scalars in the metrics."""
    state = torch.load(trained["alibi"][0] / "checkpoint_last.pt", weights_only=True)
    args = options.parse_args_and_arch(options.get_training_parser(),
                                       ["unused-data", *TRAIN_FLAGS, "--arch", "transformer_lm_alibi"])
    state["args"], state["cfg"] = args, None
    state["extra_state"]["metrics"] = {"train": [(0, "loss", "AverageMeter", {"val": np.float64(5.5),
                                                                                "count": np.int64(3)})]}
    torch.save(state, path)


@pytest.fixture
def legacy(trained, tmp_path):
    path = tmp_path / "legacy.pt"
    legacy_checkpoint(trained, path)
    return path


def test_an_args_namespace_checkpoint_loads_as_its_original(trained, data_bin, legacy):
    assert isinstance(read_checkpoint(str(legacy))["args"], argparse.Namespace)
    original, _, _ = load_language_model(str(trained["alibi"][0] / "checkpoint_last.pt"), str(data_bin))
    model, _, cfg = load_language_model(str(legacy), str(data_bin))
    assert cfg.model.bias_kernel == "alibi" and cfg.task.tokens_per_sample == 64
    tokens = torch.arange(4, 100)[None]
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(tokens)[0], original.eval()(tokens)[0], rtol=0, atol=0)


@pytest.mark.slow  # starts the commands
def test_an_args_namespace_checkpoint_scores_as_its_original(trained, data_bin, legacy):
    """The plugin's command, and stock fairseq-eval-lm with the plugin loaded."""

    def evaluations(path):
        kerple = run_forked("kerple-eval-lm", [data_bin, "--path", path, "--cpu", "--no-progress-bar"], REPO)
        return kerple.stdout.splitlines()[-1], stock_eval_lm(data_bin, path, 64, "--user-dir", REPO / "kerple_fairseq")

    assert evaluations(legacy) == evaluations(trained["alibi"][0] / "checkpoint_last.pt")
