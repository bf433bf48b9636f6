"""Shared fixtures: a small data-bin built from the real WikiText-103 sample in ../shared."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SAMPLE = Path(os.environ.get("KERPLE_WIKITEXT_DIR", REPO.parent / "shared" / "data" / "wikitext-103-sample"))
BIN = Path(sys.executable).parent

sys.path.insert(0, str(Path(__file__).parent))


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
        pytest.fail(f"WikiText-103 sample not found in {SAMPLE} (set KERPLE_WIKITEXT_DIR)")
    return SAMPLE


@pytest.fixture(scope="session")
def data_bin(sample_dir, tmp_path_factory):
    """fairseq-preprocess --only-source on the head of each split (8000-word vocabulary)."""
    raw = tmp_path_factory.mktemp("raw")
    sizes = {"train": 600_000, "valid": 120_000, "test": 60_000}
    for split, size in sizes.items():
        text = (sample_dir / f"wiki.{split}.tokens").read_bytes()[:size]
        (raw / f"wiki.{split}.tokens").write_bytes(text[: text.rfind(b"\n") + 1])
    dest = tmp_path_factory.mktemp("data-bin")
    run([fairseq_cli("fairseq-preprocess"), "--only-source", "--nwordssrc", "8000", "--workers", "2",
         "--trainpref", raw / "wiki.train.tokens", "--validpref", raw / "wiki.valid.tokens",
         "--testpref", raw / "wiki.test.tokens", "--destdir", dest])
    return dest


TRAIN_LENGTH = 64
TRAIN_FLAGS = ["--task", "language_modeling", "--user-dir", "kerple_fairseq",
               "--decoder-layers", "2", "--decoder-embed-dim", "64", "--decoder-ffn-embed-dim", "128",
               "--decoder-attention-heads", "4", "--dropout", "0.1",
               "--tokens-per-sample", str(TRAIN_LENGTH), "--sample-break-mode", "none", "--max-tokens", "1024",
               "--optimizer", "adam", "--lr", "0.003", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "5",
               "--cpu", "--seed", "3", "--log-format", "json", "--log-interval", "1", "--num-workers", "0",
               "--disable-validation", "--no-epoch-checkpoints"]
UPDATES = 40


def train(data_bin, save_dir, updates, *flags):
    """fairseq-train a tiny model; returns the logged training losses."""
    import json

    proc = run([fairseq_cli("fairseq-train"), data_bin, *TRAIN_FLAGS, "--max-update", str(updates),
                "--save-dir", save_dir, *flags])
    return [float(json.loads(line[line.index("{"):])["loss"]) for line in (proc.stdout + proc.stderr).splitlines()
            if "train_inner" in line and "{" in line]


@pytest.fixture(scope="session")
def trained(data_bin, tmp_path_factory):
    """Tiny models trained at length 64: the two kernels of the comparison, and stock
    transformer_lm with sinusoidal and with learned positions (the baselines)."""
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
        out[name] = (save_dir, train(data_bin, save_dir, updates, *flags))
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
