"""Anything given as a checkpoint that is not a readable fairseq checkpoint gets one line: in the
library (a UsageError, the only exception) and from kerple-eval-lm and kerple-analyze (one error line,
no traceback, exit 1), with the file left as it was. Each kind of bad file, then fuzzing with random
bytes and truncations of a real checkpoint."""

import random
import zipfile

import pytest
import torch

from kerple_fairseq.analysis.kernel_curves import load_kernel
from kerple_fairseq.errors import UsageError
from kerple_fairseq.evaluation.loading import load_checkpoint_state, load_language_model

from conftest import BIN, REPO, run
from console_scripts import comparable, run_each_forked


def real_checkpoint(trained):
    return trained["alibi"][0] / "checkpoint_last.pt"


def other_fairseq_model(trained, path):
    """Stock fairseq ``transformer_lm``'s checkpoint relabelled as a translation model (fairseq's
    ``transformer`` architecture and ``translation`` task)."""
    state = torch.load(trained["sinusoidal"][0] / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    state["cfg"]["model"]["_name"] = "transformer"
    state["cfg"]["task"]["_name"] = "translation"
    torch.save(state, path)


def zip_of_something_else(path):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("notes/readme.txt", "not a checkpoint\n")


KINDS = {  # each writes its kind of file at path, from the tiny trained models
    "text": lambda trained, path: path.write_text("this is a text file, not a checkpoint\n" * 20),
    "random bytes": lambda trained, path: path.write_bytes(random.Random(0).randbytes(50_000)),
    "truncated": lambda trained, path: path.write_bytes(real_checkpoint(trained).read_bytes()[:20_000]),
    "empty": lambda trained, path: path.write_bytes(b""),
    "directory": lambda trained, path: path.mkdir(),
    "zip of something else": lambda trained, path: zip_of_something_else(path),
    "state dict without a config": lambda trained, path: torch.save({"weight": torch.zeros(3)}, path),
    "model state without a config": lambda trained, path: torch.save(
        {"model": torch.load(real_checkpoint(trained), map_location="cpu", weights_only=True)["model"]}, path),
    "another fairseq model": other_fairseq_model,
}
MESSAGES = {
    "empty": "is an empty file",
    "directory": "is a directory; give a checkpoint file in it",
    "state dict without a config": "is not a fairseq checkpoint (no model configuration in it)",
    "model state without a config": "is not a fairseq checkpoint (no model configuration in it)",
}


@pytest.fixture
def bad_file(request, trained, tmp_path):
    kind = request.param
    path = tmp_path / "checkpoint.pt"
    KINDS[kind](trained, path)
    return kind, path


def contents(path):
    return None if path.is_dir() else path.read_bytes()


def assert_one_line_usage_error(load, path, expected):
    with pytest.raises(UsageError) as error:
        load()
    message = str(error.value)
    assert "\n" not in message and "\x1b" not in message and str(path) in message, message
    assert expected in message, message


@pytest.mark.parametrize("bad_file", list(KINDS), indirect=True)
def test_each_kind_of_bad_file_is_one_line_in_the_library(bad_file, data_bin):
    kind, path = bad_file
    before = contents(path)
    expected = MESSAGES.get(kind, "")
    if kind != "another fairseq model":  # PyTorch and fairseq read it; only building the model fails
        assert_one_line_usage_error(lambda: load_checkpoint_state(str(path)), path, expected or "cannot read checkpoint")
    assert_one_line_usage_error(lambda: load_language_model(str(path), str(data_bin)), path, expected)
    if kind == "another fairseq model":
        assert_one_line_usage_error(lambda: load_kernel(str(path), "x"), path, "not a kerple_fairseq checkpoint")
    else:
        assert_one_line_usage_error(lambda: load_kernel(str(path), "x"), path, expected)
    assert contents(path) == before


def test_fuzzed_checkpoints_are_one_line(trained, data_bin, tmp_path):
    """Random cuts of a real checkpoint and random bytes written over part of it: every load either
    succeeds or raises a one-line UsageError, and none changes the file."""
    real = real_checkpoint(trained).read_bytes()
    rng = random.Random(1)
    path = tmp_path / "fuzzed.pt"
    outcomes = {"loaded": 0, "refused": 0}
    for trial in range(40):
        if trial % 2 == 0:
            data = real[: rng.randrange(1, len(real))]
        else:
            start = rng.randrange(len(real))
            data = bytearray(real)
            data[start:start + 64] = rng.randbytes(len(data[start:start + 64]))
            data = bytes(data)
        path.write_bytes(data)
        try:
            load_language_model(str(path), str(data_bin))
            outcomes["loaded"] += 1
        except UsageError as e:
            assert "\n" not in str(e) and str(path) in str(e), str(e)
            outcomes["refused"] += 1
        assert path.read_bytes() == data
    assert outcomes["refused"] >= 20, outcomes  # every truncation at least


def commands(data_bin, path, folder):
    return {"kerple-eval-lm": [data_bin, "--path", path, "--cpu", "--no-progress-bar"],
            "kerple-analyze": ["kernels", "--path", path, "--out", folder / "analysis"]}


@pytest.fixture(scope="module")
def command_runs(trained, data_bin, tmp_path_factory):
    """kerple-eval-lm and kerple-analyze on each kind of bad file, forked from one process
    (tests/console_scripts.py): by kind, (the file, its contents before, its folder, {program: run})."""
    prepared, runs = {}, []
    for kind in KINDS:
        folder = tmp_path_factory.mktemp("bad-file")
        path = folder / "checkpoint.pt"
        KINDS[kind](trained, path)
        prepared[kind] = (path, contents(path), folder)
        runs += [(prog, args, REPO) for prog, args in commands(data_bin, path, folder).items()]
    done = iter(run_each_forked(runs, check=False))
    return {kind: (*prepared[kind], {prog: next(done) for prog in ("kerple-eval-lm", "kerple-analyze")})
            for kind in KINDS}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
def test_each_kind_of_bad_file_is_one_line_from_the_commands(command_runs, kind):
    path, before, folder, runs = command_runs[kind]
    for prog, proc in runs.items():
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, (prog, kind, proc.stderr[-3000:])
        assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: ") and str(path) in lines[0], (prog, lines)
        assert "\x1b" not in proc.stderr
    assert contents(path) == before
    assert not (folder / "analysis").exists()


@pytest.mark.slow
def test_the_commands_alone_report_a_bad_file_as_among_others(command_runs, data_bin, tmp_path):
    """The installed commands started alone, as a user types them, print what they print forked among
    the others."""
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(command_runs["truncated"][0].read_bytes())
    for prog, args in commands(data_bin, path, tmp_path).items():
        alone = run([BIN / prog, *args], check=False)
        among = command_runs["truncated"][3][prog]
        assert among.returncode == 1 and comparable(alone, tmp_path) == comparable(among, command_runs["truncated"][2])
