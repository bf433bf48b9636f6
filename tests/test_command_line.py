"""Bad input on the command line: one clear line and a non-zero exit; --user-dir resolution."""

import os
import sys

import pytest

from kerple_fairseq.experiments.language_models import model_size_flags
from kerple_fairseq.experiments.recipe import cpu_training_flags

from conftest import REPO, fairseq_cli, run
from console_scripts import run_forked

pytestmark = pytest.mark.slow  # fairseq-train and Python processes

TINY = [*model_size_flags(layers=1, width=16, heads=2, ffn=16),
        *cpu_training_flags(16, max_tokens=64, lr=0.001, warmup_updates=1, seed=1, log_format="simple", log_interval=1),
        "--max-update", "1"]


def train_command(data_bin, save_dir, *flags, user_dir="kerple_fairseq"):
    return [fairseq_cli("fairseq-train"), data_bin, "--user-dir", user_dir, *TINY, "--save-dir", save_dir, *flags]


def train_forked(data_bin, save_dir, *flags, check=False):
    """fairseq-train forked (:mod:`console_scripts`), as the stock commands' bad inputs are."""
    return run_forked("fairseq-train", train_command(data_bin, save_dir, *flags)[1:], REPO, check=check)


def assert_one_line_error(proc, expected, save_dir):
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and "usage:" not in proc.stderr, proc.stderr[-2000:]
    # fairseq-train's log lines come before; the error is the one line that says so
    assert [line for line in proc.stderr.splitlines() if "error" in line.lower()] == [proc.stderr.strip().splitlines()[-1]]
    assert expected in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]
    assert not list(save_dir.glob("*.pt")), "no checkpoint written"


def test_unknown_kernel(data_bin, tmp_path):
    proc = train_forked(data_bin, tmp_path, "--arch", "transformer_lm_kerple", "--bias-kernel", "kerple_logg")
    assert_one_line_error(proc, "argument --bias-kernel: invalid choice: 'kerple_logg'", tmp_path)


def test_kernel_option_out_of_range(data_bin, tmp_path):
    proc = train_forked(data_bin, tmp_path, "--arch", "transformer_lm_kerple", "--kernel-param-floor", "0")
    assert_one_line_error(proc, "kerple_fairseq: error: --kernel-param-floor must be in (0, 1), got 0.0", tmp_path)


def test_bias_kernel_with_token_positions_left_on(data_bin, tmp_path):
    proc = train_forked(data_bin, tmp_path, "--arch", "transformer_lm_alibi", "--token-positional-embeddings")
    assert_one_line_error(proc, "kerple_fairseq: error: --bias-kernel alibi already encodes position", tmp_path)


def test_the_fused_backend_asked_for_where_it_cannot_run(data_bin, tmp_path):
    proc = run(train_command(data_bin, tmp_path, "--arch", "transformer_lm_kerple", "--attention-backend", "fused"),
               check=False, env={**os.environ, "TRITON_INTERPRET": "0"})
    assert_one_line_error(proc, "kerple_fairseq: error: --attention-backend fused runs on CUDA GPUs with Triton, and "
                          "the model is on CPU: choose --attention-backend auto", tmp_path)


def test_none_kernel_with_token_positions_is_the_absolute_position_baseline(data_bin, tmp_path):
    train_forked(data_bin, tmp_path, "--arch", "transformer_lm_kerple", "--bias-kernel", "none",
                 "--token-positional-embeddings", check=True)
    import torch

    state = torch.load(tmp_path / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    assert state["cfg"]["model"]["no_token_positional_embeddings"] is False


@pytest.mark.parametrize("where", ["another directory", "the repository root"])
def test_user_dir_after_the_plugin_was_imported(tmp_path, where):
    """`--user-dir kerple_fairseq` resolves to the repository's folder from its root, and elsewhere
    to <site-packages>/fairseq/../kerple_fairseq, the installed package. With the package already
    imported (as kerple-eval-lm does), neither may be refused as 'not globally unique'."""
    script = (
        "import argparse, os, kerple_fairseq\n"
        "from fairseq import utils\n"
        "utils.import_user_module(argparse.Namespace(user_dir='kerple_fairseq'))\n"
        "print('resolved', os.path.realpath(kerple_fairseq.__path__[0]))\n"
    )
    proc = run([sys.executable, "-c", script], cwd=tmp_path if where == "another directory" else REPO)
    assert "resolved" in proc.stdout
