"""Shared fixtures: a small data-bin built from the real WikiText-103 sample in ../shared."""

import os
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
