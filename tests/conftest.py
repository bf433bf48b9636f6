"""Shared fixtures: a small data-bin built from the real WikiText-103 sample in ../shared, and tiny
models trained on it."""

import functools
import importlib.util
import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path

import pytest

# without a GPU, Triton's kernels (the fused attention backend) run on CPU tensors under its interpreter,
# which must be chosen before Triton is first imported
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

sys.path[:0] = [str(Path(__file__).parent), str(REPO)]  # helpers; this checkout's kerple_fairseq

if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None:
    import triton_interpreter  # noqa: E402

    triton_interpreter.install()

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
    config.addinivalue_line("markers", "fused: the fused Triton backend's tests, on CUDA where a GPU is (in "
                            "scripts/gpu-check.sh's tier too), else under Triton's interpreter")
    config.addinivalue_line("markers", "cross_compile: compiles GPU kernels on a machine without a GPU; "
                            "scripts/gpu-check.sh's tier leaves these out")
    config.addinivalue_line("markers", "xdist_group(name): tests pytest-xdist's --dist loadgroup runs in one worker")
    if WORKER:
        _share_the_cpus(config)


# -------------------------------------------------------------------------------- pytest-xdist
# scripts/run-tests.sh runs the suite in pytest-xdist workers (-n 2 --dist loadgroup). A worker is a
# process of its own: a session fixture runs once per worker, a module fixture once per worker that
# runs a test of its module. So the session fixtures that train or preprocess build once for all
# workers (built_once), the tests of a module with a module fixture run in one worker
# (pytest_xdist_make_scheduler), and the workers share the CPUs rather than each taking all of them.
# Without pytest-xdist all of this is as before.

WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", ...; None outside pytest-xdist's workers


def _share_the_cpus(config):
    """Each worker's share of the CPUs as torch's thread count here and OpenMP's in the processes the
    tests start (unless OMP_NUM_THREADS is set): two workers with a thread per CPU each would
    oversubscribe them."""
    import torch

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    threads = int(os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cpus // workers))))
    torch.set_num_threads(threads)


def built_once(tmp_path_factory, name, build):
    """``(folder, value)``: ``value = build(folder)`` run once into a new, empty ``folder``. In
    pytest-xdist's workers, once for them all: the first worker to ask builds it under a file lock in
    a folder they share (this run's base temporary folder) and stores ``value`` (JSON) beside it; the
    others wait for it and read it."""
    if not WORKER:
        folder = tmp_path_factory.mktemp(name)
        return folder, build(folder)
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp().parent / "built-once"  # getbasetemp(): .../popen-gw0
    root.mkdir(exist_ok=True)
    folder, value = root / name, root / f"{name}.json"
    with FileLock(str(root / f"{name}.lock")):
        if not value.is_file():  # written last: not there if the build failed or is under way
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            value.write_text(json.dumps(build(folder)))
    return folder, json.loads(value.read_text())


@functools.lru_cache(maxsize=None)
def _has_module_fixture(path):
    """Whether the test module at ``path`` defines a module-scoped fixture."""
    try:
        text = Path(path).read_text()
    except OSError:
        return False
    return re.search(r"""@pytest\.fixture\([^)]*scope\s*=\s*["']module["']""", text) is not None


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's: unknown without it
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` (what scripts/run-tests.sh asks for) with the tests of a module that defines
    a module-scoped fixture (a trained model, a comparison run) kept in one worker, so that the fixture
    is built once rather than once in each worker that runs one of its tests; every other test is
    handed out one at a time to the first free worker. Tests with an xdist_group mark stay together
    as pytest-xdist does it, where it can: pytest 9 no longer takes the group pytest-xdist 3.8 adds to
    a test's id, so there they are handed out one at a time."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class ModulesWithFixturesTogether(LoadGroupScheduling):
        def _split_scope(self, nodeid):
            scope = super()._split_scope(nodeid)
            if scope != nodeid:  # an xdist_group mark's group
                return scope
            module = nodeid.split("::")[0]
            return module if _has_module_fixture(config.rootpath / module) else nodeid

    return ModulesWithFixturesTogether(config, log)


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
def wikitext_head(sample_dir, tmp_path_factory):
    """The head of each split of the sample, whole lines: 600 kB of train, 120 kB of valid (about 24k
    tokens), 60 kB of test, in a folder laid out as the sample is."""
    def cut(raw):
        sizes = {"train": 600_000, "valid": 120_000, "test": 60_000}
        for split, size in sizes.items():
            text = (sample_dir / f"wiki.{split}.tokens").read_bytes()[:size]
            (raw / f"wiki.{split}.tokens").write_bytes(text[: text.rfind(b"\n") + 1])

    raw, _ = built_once(tmp_path_factory, "raw", cut)
    return raw


@pytest.fixture(scope="session")
def data_bin(wikitext_head, tmp_path_factory):
    """fairseq-preprocess --only-source on the head of each split (8000-word vocabulary)."""
    def build(data):
        preprocess(wikitext_head, data / "data-bin", vocab_size=8000, workers=2, log=lambda message: None)

    data, _ = built_once(tmp_path_factory, "data", build)
    return data / "data-bin"


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


TRAINED = {  # the models of ``trained``: flags, updates
    "alibi": (["--arch", "transformer_lm_kerple", "--bias-kernel", "alibi"], UPDATES),
    "kerple_log": (["--arch", "transformer_lm_kerple", "--bias-kernel", "kerple_log"], UPDATES),
    "sinusoidal": (["--arch", "transformer_lm"], 10),
    "learned": (["--arch", "transformer_lm", "--decoder-learned-pos"], 10),
}


class _Trained(Mapping):
    """:data:`TRAINED`'s models by name, each trained when first asked for (once for all of
    pytest-xdist's workers, which may train different ones at the same time)."""

    def __init__(self, data_bin, tmp_path_factory):
        self._data_bin, self._factory, self._runs = data_bin, tmp_path_factory, {}

    def __getitem__(self, name):
        if name not in self._runs:
            flags, updates = TRAINED[name]
            self._runs[name] = built_once(self._factory, f"ckpt-{name}",
                                          lambda save_dir: train_in_process(self._data_bin, save_dir, updates, *flags))
        return self._runs[name]

    def __iter__(self):
        return iter(TRAINED)

    def __len__(self):
        return len(TRAINED)


@pytest.fixture(scope="session")
def trained(data_bin, tmp_path_factory):
    """Tiny models trained at length 64: the two kernels of the comparison, and stock
    transformer_lm with sinusoidal and with learned positions (the baselines); by name,
    (save_dir, training losses), each trained when a test first asks for it."""
    return _Trained(data_bin, tmp_path_factory)


def stock_eval_lm_args(data_bin, checkpoint, length, *extra, split="valid"):
    """fairseq-eval-lm's arguments for ``split`` in non-overlapping blocks of ``length``."""
    return [data_bin, "--path", checkpoint, "--gen-subset", split, "--tokens-per-sample", str(length),
            "--context-window", "0", "--max-sentences", "1", "--cpu", "--num-workers", "0", *extra]


def stock_eval_lm(data_bin, checkpoint, length, *extra):
    """Stock fairseq-eval-lm in non-overlapping blocks, forked (:mod:`console_scripts`): (tokens scored, base-2
    loss, perplexity)."""
    from console_scripts import run_forked

    return eval_lm_result(run_forked("fairseq-eval-lm", stock_eval_lm_args(data_bin, checkpoint, length, *extra), REPO))


def eval_lm_result(proc):
    """(tokens scored, base-2 loss, perplexity) as fairseq-eval-lm's run ``proc`` reports them."""
    out = proc.stdout + proc.stderr
    tokens = int(re.search(r"Evaluated ([\d,]+) tokens", out).group(1).replace(",", ""))
    loss, ppl = map(float, re.search(r"Loss \(base 2\): ([\d.]+), Perplexity: ([\d.]+)", out).groups())
    return tokens, loss, ppl
