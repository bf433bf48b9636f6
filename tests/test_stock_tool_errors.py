"""Bad input through fairseq's own commands, the plugin loaded with ``--user-dir kerple_fairseq``: a
folder that is not a data-bin, a split it lacks, a checkpoint that does not exist, is truncated, asks
for code, or was trained on another dictionary, an option a command checks with ``assert``, a sample
or batch below one token, a batch smaller than every sample, or than all but a few. Each ends
in one ``kerple_fairseq: error:`` line and a non-zero exit, with no traceback, no ``--save-dir`` left
behind, and the files given left as they were. The hub interface loads a plugin checkpoint without
``import kerple_fairseq`` when told the plugin's folder (fairseq's ``user_dir=``)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import BIN, REPO, TRAIN_FLAGS, run
from console_scripts import comparable, run_each_forked

pytestmark = pytest.mark.slow  # a process per command, forked from one that imported fairseq

USER_DIR = ["--user-dir", str(REPO / "kerple_fairseq")]
ARCH = ["--arch", "transformer_lm_kerple", "--bias-kernel", "alibi"]
SAVED = REPO / "tests" / "data" / "saved-checkpoints"  # tiny checkpoints and their 200-word dict.txt
CHECKPOINT = SAVED / "alibi.pt"
EXCEPTION_LINE = re.compile(r"^\w+(Error|Exception|Interrupt)\b")


def truncated(path):
    path.write_bytes(CHECKPOINT.read_bytes()[:2000])


def asking_for_code(path):
    torch.save({"model": {}, "cfg": {}, "hook": os.system}, path)  # pickles a reference to os.system


def a_split_short(tmp_path):
    """A data-bin of the saved checkpoints' dictionary with no splits at all."""
    folder = tmp_path / "no-splits"
    folder.mkdir()
    (folder / "dict.txt").write_bytes((SAVED / "dict.txt").read_bytes())
    return folder


def train(data, save_dir, *extra):
    return [BIN / "fairseq-train", data, *TRAIN_FLAGS, *ARCH, "--max-update", "1", "--save-dir", save_dir, *extra]


def train_without_a_batch_size(data, save_dir):
    at = TRAIN_FLAGS.index("--max-tokens")
    return [BIN / "fairseq-train", data, *TRAIN_FLAGS[:at], *TRAIN_FLAGS[at + 2:], *ARCH, "--save-dir", save_dir]


def eval_lm(data, path, *extra):
    return [BIN / "fairseq-eval-lm", data, *USER_DIR, "--path", path, "--cpu", *extra]


def interactive(data, path):
    return [BIN / "fairseq-interactive", data, *USER_DIR, "--task", "language_modeling", "--path", path, "--cpu"]


def generate(data, path=None):
    checkpoint = [] if path is None else ["--path", path]
    return [BIN / "fairseq-generate", data, *USER_DIR, "--task", "language_modeling", *checkpoint, "--cpu",
            "--sampling", "--beam", "1", "--nbest", "1", "--max-len-b", "4"]


def hydra_train(data, save_dir, tmp_path):
    return [BIN / "fairseq-hydra-train", "--config-dir", REPO / "docs" / "hydra", "--config-name", "kerple_lm",
            f"task.data={data}", f"common.user_dir={REPO / 'kerple_fairseq'}", "common.cpu=true",
            f"checkpoint.save_dir={save_dir}", f"hydra.run.dir={tmp_path / 'hydra-outputs'}"]


# each case: (command from (tmp_path, data_bin, save_dir, bad checkpoint), what the line says, a file to
# write at the bad checkpoint's path first)
CASES = {
    "train: no such data-bin": (lambda t, d, s, c: train(t / "no-such-dir", s), "is not a fairseq data-bin", None),
    "train: a folder without dict.txt": (lambda t, d, s, c: train(t, s), "is not a fairseq data-bin", None),
    "train: a file given as the data-bin": (lambda t, d, s, c: train(d / "dict.txt", s), "is not a fairseq data-bin",
                                            None),
    "train: no valid split": (lambda t, d, s, c: train(a_split_short(t), s), "has no 'train' split", None),
    "train: truncated --restore-file": (lambda t, d, s, c: train(d, s, "--restore-file", c),
                                        "not a PyTorch file, or a damaged or truncated one", truncated),
    "train: --restore-file asking for code": (lambda t, d, s, c: train(d, s, "--restore-file", c),
                                              "refused to read checkpoint", asking_for_code),
    "train: no --max-tokens or --batch-size": (lambda t, d, s, c: train_without_a_batch_size(d, s),
                                               "Must specify batch size either with --max-tokens or --batch-size",
                                               None),
    "train: --tokens-per-sample 0": (lambda t, d, s, c: train(d, s, "--tokens-per-sample", "0"),
                                     "--tokens-per-sample must be >= 1", None),
    "train: --tokens-per-sample -3 --sample-break-mode eos": (
        lambda t, d, s, c: train(d, s, "--tokens-per-sample", "-3", "--sample-break-mode", "eos"),
        "--tokens-per-sample must be >= 1", None),
    "train: --max-tokens 0": (lambda t, d, s, c: train(d, s, "--max-tokens", "0"), "--max-tokens (and", None),
    "train: --max-tokens below --tokens-per-sample": (lambda t, d, s, c: train(d, s, "--max-tokens", "7"),
                                                      "is below the shortest sample (", None),
    "train: --max-tokens that leaves no batch": (lambda t, d, s, c: train(d, s, "--max-tokens", "50"),
                                                 "no batch could be made", None),
    "hydra-train: task.tokens_per_sample=0": (lambda t, d, s, c: hydra_train(d, s, t) + ["task.tokens_per_sample=0"],
                                              "--tokens-per-sample must be >= 1", None),
    "hydra-train: no such data-bin": (lambda t, d, s, c: hydra_train(t / "no-such-dir", s, t),
                                      "is not a fairseq data-bin", None),
    "eval-lm: no such data-bin": (lambda t, d, s, c: eval_lm(t / "no-such-dir", CHECKPOINT),
                                  "is not a fairseq data-bin", None),
    "eval-lm: --tokens-per-sample 0": (lambda t, d, s, c: eval_lm(d, CHECKPOINT, "--tokens-per-sample", "0"),
                                       "--tokens-per-sample must be >= 1", None),
    "eval-lm: no such checkpoint": (lambda t, d, s, c: eval_lm(d, t / "nope.pt"), "does not exist", None),
    "eval-lm: truncated checkpoint": (lambda t, d, s, c: eval_lm(d, c), "damaged or truncated", truncated),
    "eval-lm: checkpoint asking for code": (lambda t, d, s, c: eval_lm(d, c), "refused to read checkpoint",
                                            asking_for_code),
    "eval-lm: another dictionary": (lambda t, d, s, c: eval_lm(d, CHECKPOINT),
                                    "the checkpoint does not fit the data-bin's dictionary", None),
    "eval-lm: no such split": (lambda t, d, s, c: eval_lm(a_split_short(t), CHECKPOINT, "--gen-subset", "valid"),
                               "has no 'valid' split", None),
    "interactive: no such data-bin": (lambda t, d, s, c: interactive(t / "no-such-dir", CHECKPOINT),
                                      "is not a fairseq data-bin", None),
    "interactive: no such checkpoint": (lambda t, d, s, c: interactive(SAVED, t / "nope.pt"), "does not exist", None),
    "interactive: truncated checkpoint": (lambda t, d, s, c: interactive(SAVED, c), "damaged or truncated",
                                          truncated),
    "generate: no such data-bin": (lambda t, d, s, c: generate(t / "no-such-dir", CHECKPOINT),
                                   "is not a fairseq data-bin", None),
    "generate: no --path": (lambda t, d, s, c: generate(SAVED),
                            "--path required for generation", None),
    "generate: checkpoint asking for code": (lambda t, d, s, c: generate(SAVED, c), "refused to read checkpoint",
                                             asking_for_code),
}


@pytest.fixture(scope="module")
def case_runs(data_bin, tmp_path_factory):
    """Each case's command in a folder of its own, forked from one process (tests/console_scripts.py):
    by case, (its run, its folder, its bad checkpoint's path, that file's bytes before the run)."""
    prepared, runs = {}, []
    for case, (command, _, bad_file) in CASES.items():
        folder = tmp_path_factory.mktemp("case")
        checkpoint, save_dir = folder / "bad.pt", folder / "checkpoints" / "run"
        if bad_file:
            bad_file(checkpoint)
        prepared[case] = (folder, checkpoint, checkpoint.read_bytes() if bad_file else None)
        program, *args = command(folder, data_bin, save_dir, checkpoint)
        runs.append((Path(program).name, args, folder, "hello\n"))
    done = run_each_forked(runs, check=False)
    return {case: (proc, *prepared[case]) for case, proc in zip(CASES, done)}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_to_a_stock_command_is_one_line(case, case_runs):
    proc, folder, checkpoint, before = case_runs[case]
    expected = CASES[case][1]
    reports = [line for line in proc.stderr.splitlines() if line.startswith("kerple_fairseq: error: ")]
    assert proc.returncode != 0 and len(reports) == 1 and expected in reports[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not any(EXCEPTION_LINE.match(line) for line in proc.stderr.splitlines())
    assert not (folder / "checkpoints").exists(), "the refused run left its --save-dir behind"
    assert (checkpoint.read_bytes() if before is not None else None) == before


@pytest.mark.parametrize("case", ["eval-lm: truncated checkpoint", "train: --max-tokens that leaves no batch",
                                  "interactive: truncated checkpoint"])
def test_a_stock_command_alone_prints_what_it_prints_among_others(case_runs, data_bin, tmp_path, case):
    """A case's command started alone, as a user types it, prints what it prints forked among the others."""
    command, _, bad_file = CASES[case]
    if bad_file:
        bad_file(tmp_path / "bad.pt")
    alone = run(command(tmp_path, data_bin, tmp_path / "checkpoints" / "run", tmp_path / "bad.pt"), cwd=tmp_path,
                check=False, input="hello\n")
    among, folder = case_runs[case][:2]
    assert comparable(alone, tmp_path) == comparable(among, folder)


def test_a_run_that_saves_makes_its_save_dir(data_bin, tmp_path):
    """The counterpart: --save-dir, several folders deep, is made when the first checkpoint is saved."""
    save_dir = tmp_path / "a" / "b" / "run"
    run([BIN / "fairseq-train", data_bin, *TRAIN_FLAGS, *ARCH, "--max-update", "2", "--save-dir", save_dir], cwd=tmp_path)
    assert (save_dir / "checkpoint_last.pt").is_file()


HUB_WITHOUT_IMPORT = """
import sys
from fairseq.models.transformer_lm import TransformerLanguageModel
lm = TransformerLanguageModel.from_pretrained(sys.argv[1], "alibi.pt", sys.argv[1], user_dir=sys.argv[2])
assert "kerple_fairseq" in sys.modules
print(type(lm.models[0]).__name__, type(lm.models[0].decoder.setup.bias.kernel).__name__)
"""


def test_the_hub_interface_loads_a_plugin_checkpoint_given_the_plugin_folder(tmp_path):
    proc = subprocess.run([sys.executable, "-c", HUB_WITHOUT_IMPORT, str(SAVED), str(REPO / "kerple_fairseq")],
                          cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["KernelBiasedLanguageModel", "AlibiKernel"], proc.stdout


def test_a_save_dir_that_cannot_be_written_is_not_left_behind(tmp_path):
    """fairseq's check makes the folder, then fails to write its test file: the folders it made go again."""
    from kerple_fairseq.training.save_dir import _leaving_nothing

    def unwritable(save_dir):
        os.makedirs(save_dir)
        raise PermissionError(f"cannot write in {save_dir}")

    with pytest.raises(PermissionError):
        _leaving_nothing(unwritable)(str(tmp_path / "checkpoints" / "run"))
    assert not (tmp_path / "checkpoints").exists()
