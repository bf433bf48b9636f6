"""Shared fixtures: a small data-bin built from the real WikiText-103 sample in ../shared, and tiny
models trained on it."""

import json
import logging
import math
import re
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

sys.path[:0] = [str(Path(__file__).parent), str(REPO)]  # helpers; this checkout's kerple_fairseq

from kerple_fairseq.experiments.paths import sample_places  # noqa: E402

# the WikiText-103 sample: the first of its places that holds it
SAMPLE_PLACES = sample_places(REPO)
SAMPLE = next((p for p in SAMPLE_PLACES if (p / "wiki.valid.tokens").is_file()), SAMPLE_PLACES[0])

from kerple_fairseq.experiments.language_models import model_size_flags  # noqa: E402
from kerple_fairseq.experiments.recipe import cpu_training_flags  # noqa: E402
from kerple_fairseq.experiments.wikitext103 import preprocess  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: starts processes (fairseq-train, fairseq-eval-lm, the scripts); "
                            "deselect with -m 'not slow'")
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU; scripts/gpu-check.sh runs this tier (-m cuda)")
    config.addinivalue_line("markers", "xdist_group(name): tests pytest-xdist's --dist loadgroup runs in one worker")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU: scripts/gpu-check.sh runs this tier where one is")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(no_gpu)


def run(args, cwd=REPO, check=True, **kwargs):
    """Run a command line; on failure show its output."""
    proc = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, **kwargs)
    if check and proc.returncode != 0:
        raise AssertionError(f"{args[0]} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def fairseq_cli(name):
    return BIN / name


@pytest.fixture(scope="session")
def sample_dir():
    missing = [s for s in ("train", "valid", "test") if not (SAMPLE / f"wiki.{s}.tokens").is_file()]
    if missing:
        # not a skip: these tests are the end-to-end check and must run in CI
        pytest.fail(f"WikiText-103 sample not found in {' or '.join(map(str, SAMPLE_PLACES))}: run the main job "
                    "(bash scripts/run-small-comparison.sh), which downloads it, or set KERPLE_WIKITEXT_DIR")
    return SAMPLE


@pytest.fixture(scope="session")
def data_bin(sample_dir, tmp_path_factory):
    """fairseq-preprocess --only-source on the head of each split (8000-word vocabulary)."""
    raw = tmp_path_factory.mktemp("raw")
    sizes = {"train": 600_000, "valid": 120_000, "test": 60_000}
    for split, size in sizes.items():
        text = (sample_dir / f"wiki.{split}.tokens").read_bytes()[:size]
        (raw / f"wiki.{split}.tokens").write_bytes(text[: text.rfind(b"\n") + 1])
    dest = tmp_path_factory.mktemp("data") / "data-bin"
    preprocess(raw, dest, vocab_size=8000, workers=2, log=lambda message: None)
    return dest


TRAIN_LENGTH = 64
TRAIN_FLAGS = ["--user-dir", str(REPO / "kerple_fairseq"), *model_size_flags(layers=2, width=64, heads=4, dropout=0.1),
               *cpu_training_flags(TRAIN_LENGTH, max_tokens=1024, lr=0.003, warmup_updates=5, seed=3,
                                   log_format="json", log_interval=1)]
UPDATES = 40


def training_args(data_bin, save_dir, updates, *flags):
    return [str(data_bin), *TRAIN_FLAGS, "--max-update", str(updates), "--save-dir", str(save_dir), *map(str, flags)]


def train(data_bin, save_dir, updates, *flags):
    """fairseq-train a tiny model; returns the logged training losses."""
    proc = run([fairseq_cli("fairseq-train"), *training_args(data_bin, save_dir, updates, *flags)])
    return [float(json.loads(line[line.index("{"):])["loss"]) for line in (proc.stdout + proc.stderr).splitlines()
            if "train_inner" in line and "{" in line]


class _TrainingLosses(logging.Handler):
    """Collects the loss of each ``train_inner`` record that fairseq's JSON progress bar logs."""

    def __init__(self):
        super().__init__()
        self.losses = []

    def emit(self, record):
        if record.name == "train_inner":
            self.losses.append(float(json.loads(record.getMessage())["loss"]))


@contextmanager
def _training_losses():
    """The progress bar's records at INFO go to a :class:`_TrainingLosses` while inside; its logger's
    level and handlers are as they were afterwards."""
    logger = logging.getLogger("fairseq.logging.progress_bar")  # renamed to the record's tag while logging
    handler, level = _TrainingLosses(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler.losses
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def train_in_process(data_bin, save_dir, updates, *flags):
    """:func:`train` in this process, through fairseq-train's own ``main``: the same checkpoint and
    losses, without starting Python, torch and fairseq again."""
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq_cli.train import main

    # one process even where GPUs would make fairseq's default world size larger
    args = options.parse_args_and_arch(
        options.get_training_parser(), training_args(data_bin, save_dir, updates, *flags, "--distributed-world-size", 1))
    with _training_losses() as losses:
        main(convert_namespace_to_omegaconf(args))
    return losses


def assert_finite_falling_loss(losses, updates, run):
    """``updates`` finite losses whose mean over the last three is at least 0.4 below the first three's."""
    assert len(losses) == updates and all(math.isfinite(x) for x in losses), losses
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 0.4, f"{run}: loss {first:.2f} -> {last:.2f}"


@pytest.fixture(scope="session")
def trained(data_bin, tmp_path_factory):
    """Tiny models trained at length 64: the two kernels of the comparison, and stock
    transformer_lm with sinusoidal and with learned positions (the baselines); by name,
    (save_dir, training losses)."""
    runs = {
        "alibi": ["--arch", "transformer_lm_kerple", "--bias-kernel", "alibi"],
        "kerple_log": ["--arch", "transformer_lm_kerple", "--bias-kernel", "kerple_log"],
        "sinusoidal": ["--arch", "transformer_lm"],
        "learned": ["--arch", "transformer_lm", "--decoder-learned-pos"],
    }
    out = {}
    for name, flags in runs.items():
        save_dir = tmp_path_factory.mktemp(f"ckpt-{name}")
        updates = UPDATES if name in ("alibi", "kerple_log") else 10
        out[name] = (save_dir, train_in_process(data_bin, save_dir, updates, *flags))
    return out


def stock_eval_lm(data_bin, checkpoint, length, *extra):
    """Stock fairseq-eval-lm in non-overlapping blocks: (tokens scored, base-2 loss, perplexity)."""
    proc = run([fairseq_cli("fairseq-eval-lm"), data_bin, "--path", checkpoint, "--gen-subset", "valid",
                "--tokens-per-sample", str(length), "--context-window", "0", "--max-sentences", "1",
                "--cpu", "--num-workers", "0", *extra])
    out = proc.stdout + proc.stderr
    tokens = int(re.search(r"Evaluated ([\d,]+) tokens", out).group(1).replace(",", ""))
    loss, ppl = map(float, re.search(r"Loss \(base 2\): ([\d.]+), Perplexity: ([\d.]+)", out).groups())
    return tokens, loss, ppl
