"""scripts/prepare-wikitext-103.sh: download over HTTP (a local server), checksum, unpack,
preprocess; offline, interrupted and repeated runs. Slow: each runs the script or fairseq-preprocess."""

import hashlib
import http.server
import os
import sys
import threading
import zipfile

import pytest

from kerple_fairseq.experiments.small_comparison import downloaded_sample
from kerple_fairseq.experiments.wikitext103 import (
    OFFICIAL_MD5, OFFICIAL_URL, SAMPLE_TRAIN_BYTES, PrepareError, preprocess, sample)

from conftest import REPO, run
from console_scripts import run_forked

SCRIPT = REPO / "scripts" / "prepare_wikitext_103.py"


@pytest.fixture(scope="module")
def archive(sample_dir, tmp_path_factory):
    """wikitext-103-v1.zip's layout, built from the heads of the shared sample."""
    path = tmp_path_factory.mktemp("archive") / "wikitext-103-v1.zip"
    sizes = {"train": 300_000, "valid": 100_000, "test": 50_000}
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for split, size in sizes.items():
            text = (sample_dir / f"wiki.{split}.tokens").read_bytes()[:size]
            z.writestr(f"wikitext-103/wiki.{split}.tokens", text[: text.rfind(b"\n") + 1])
    return path


@pytest.fixture(scope="module")
def server(archive):
    """127.0.0.1 serving /wikitext-103-v1.zip whole and /cut.zip announced whole but cut halfway."""
    payload = archive.read_bytes()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path not in ("/wikitext-103-v1.zip", "/cut.zip"):
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload if self.path != "/cut.zip" else payload[: len(payload) // 2])
            self.wfile.flush()
            self.close_connection = True

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def prepare(tmp_path, *flags, check=True):
    """The script, forked (:mod:`console_scripts`): its own imports done once; fairseq-preprocess, which it
    starts, a process of its own."""
    return run_forked(str(SCRIPT), ["--download-dir", tmp_path / "downloads", "--dest", tmp_path / "data-bin",
                                    "--workers", "1", *flags], REPO, check=check)


def md5(path):
    return hashlib.md5(path.read_bytes()).hexdigest()


def assert_data_bin(path):
    for name in ["dict.txt"] + [f"{s}.{e}" for s in ("train", "valid", "test") for e in ("bin", "idx")]:
        assert (path / name).is_file(), name


def assert_one_line_error(proc, expected):
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert len(errors) == 1 and errors[0].startswith("prepare-wikitext-103: error:"), proc.stderr
    assert expected in errors[0] and proc.stderr.strip().endswith(errors[0]), proc.stderr


@pytest.mark.slow
def test_download_verify_unpack_preprocess_then_reuse(tmp_path, server, archive):
    prepare(tmp_path, "--url", f"{server}/wikitext-103-v1.zip", "--md5", md5(archive))
    assert_data_bin(tmp_path / "data-bin")
    assert (tmp_path / "downloads" / "wikitext-103-v1.zip").read_bytes() == archive.read_bytes()
    assert not list(tmp_path.rglob("*.part")) and not list(tmp_path.rglob("*.partial"))
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "data-bin").iterdir()}
    # a second run downloads and preprocesses nothing (the server is not even asked)
    proc = prepare(tmp_path, "--url", "http://127.0.0.1:9/unused.zip", "--md5", md5(archive))
    assert "is up to date" in proc.stderr
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "data-bin").iterdir()} == before


def test_official_source_and_checksum_are_the_defaults():
    assert OFFICIAL_URL == "https://wikitext.smerity.com/wikitext-103-v1.zip"
    assert OFFICIAL_MD5 == "9ddaacaf6af0710eda8c456decff7832"


@pytest.mark.slow
def test_wrong_checksum_keeps_nothing(tmp_path, server):
    proc = prepare(tmp_path, "--url", f"{server}/wikitext-103-v1.zip", check=False)  # the official md5
    assert_one_line_error(proc, "does not have the expected md5 9ddaacaf")
    assert not (tmp_path / "data-bin").exists() and not list((tmp_path / "downloads").iterdir())


@pytest.mark.slow
def test_interrupted_download_is_not_mistaken_for_a_good_one(tmp_path, server, archive):
    proc = prepare(tmp_path, "--url", f"{server}/cut.zip", "--md5", md5(archive), check=False)
    assert_one_line_error(proc, "")
    assert not (tmp_path / "data-bin").exists() and not list((tmp_path / "downloads").iterdir())
    prepare(tmp_path, "--url", f"{server}/wikitext-103-v1.zip", "--md5", md5(archive))
    assert_data_bin(tmp_path / "data-bin")


@pytest.mark.slow
def test_without_network_one_line_says_how_to_supply_the_files(tmp_path):
    proc = prepare(tmp_path, "--url", "http://127.0.0.1:9/wikitext-103-v1.zip", check=False)
    assert_one_line_error(proc, "cannot download http://127.0.0.1:9/wikitext-103-v1.zip")
    assert "--archive FILE" in proc.stderr and "--tokens-dir DIR" in proc.stderr
    assert not (tmp_path / "data-bin").exists()


@pytest.mark.slow
def test_offline_from_an_archive_or_a_tokens_directory(tmp_path, archive, sample_dir):
    prepare(tmp_path / "a", "--archive", archive, "--md5", md5(archive))
    assert_data_bin(tmp_path / "a" / "data-bin")
    prepare(tmp_path / "t", "--tokens-dir", sample_dir, "--vocab-size", "8000")
    assert_data_bin(tmp_path / "t" / "data-bin")
    # 8000 types, four of them fairseq's special symbols, which dict.txt does not list
    assert len((tmp_path / "t" / "data-bin" / "dict.txt").read_text().splitlines()) == 8000 - 4


@pytest.mark.slow
def test_interrupted_preprocessing_leaves_no_data_bin(tmp_path, sample_dir):
    broken = tmp_path / "broken"
    broken.mkdir()
    for split in ("train", "valid", "test"):
        os.symlink(sample_dir / f"wiki.{split}.tokens", broken / f"wiki.{split}.tokens")
    (broken / "wiki.valid.tokens").unlink()
    (broken / "wiki.valid.tokens").write_bytes(b"\xff\xfe not utf-8 \xff\n")  # fairseq-preprocess fails on it
    dest = tmp_path / "data-bin"
    with pytest.raises(PrepareError, match="fairseq-preprocess failed"):
        preprocess(broken, dest, log=lambda _: None)
    assert not dest.exists() and not (tmp_path / "data-bin.partial").exists()
    # a directory the script did not write is never overwritten
    dest.mkdir()
    (dest / "mine.txt").write_text("keep")
    with pytest.raises(PrepareError, match="was not written by this script"):
        preprocess(sample_dir, dest, log=lambda _: None)
    assert (dest / "mine.txt").read_text() == "keep"


@pytest.mark.slow
def test_a_directory_without_the_splits_is_a_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    proc = prepare(tmp_path, "--tokens-dir", tmp_path / "empty", check=False)
    assert_one_line_error(proc, "lacks wiki.train.tokens, wiki.valid.tokens, wiki.test.tokens")


@pytest.mark.slow
def test_the_small_comparison_downloads_its_sample_once(tmp_path, server, archive):
    downloads = tmp_path / "downloads"
    messages = []
    tokens = downloaded_sample(f"{server}/wikitext-103-v1.zip", downloads, md5(archive), log=messages.append)
    assert tokens == downloads / "wikitext-103-sample"
    with zipfile.ZipFile(archive) as z:
        for split in ("train", "valid", "test"):
            expected = z.read(f"wikitext-103/wiki.{split}.tokens")
            assert (downloads / "wikitext-103" / f"wiki.{split}.tokens").read_bytes() == expected
            assert (tokens / f"wiki.{split}.tokens").read_bytes() == (
                expected[:SAMPLE_TRAIN_BYTES] if split == "train" else expected)
    assert any(str(tokens) in m for m in messages)  # says where the tokens land
    # a second run needs no network
    assert downloaded_sample("http://127.0.0.1:9/unreachable.zip", downloads, md5(archive), log=print) == tokens


def test_the_sample_cut_from_the_training_split(tmp_path, sample_dir):
    """The sample in ../shared is the first 2,621,440 bytes of the training split: cut from itself it is
    unchanged, and a shorter cut is its prefix, with the validation and test splits whole."""
    whole = sample(sample_dir, tmp_path / "whole")
    short = sample(sample_dir, tmp_path / "short", train_bytes=1000)
    for split in ("train", "valid", "test"):
        source = (sample_dir / f"wiki.{split}.tokens").read_bytes()
        assert (whole / f"wiki.{split}.tokens").read_bytes() == source
        assert (short / f"wiki.{split}.tokens").read_bytes() == (source[:1000] if split == "train" else source)
    assert len(source) and (sample_dir / "wiki.train.tokens").stat().st_size == SAMPLE_TRAIN_BYTES


@pytest.mark.slow
def test_the_small_comparison_without_tokens_or_network_names_both_ways(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "WIKITEXT103_DIR"}
    proc = run([sys.executable, REPO / "scripts" / "small_comparison.py", "--url", "http://127.0.0.1:9/wikitext-103-v1.zip",
                "--download-dir", tmp_path / "downloads", "--out", tmp_path / "runs"], check=False, env=env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and lines[-1].startswith("small_comparison: error: cannot download"), proc.stderr
    assert [line for line in lines if "error" in line] == lines[-1:]
    for way in ("with network, run this command again", "--wikitext-dir DIR", "WIKITEXT103_DIR=DIR"):
        assert way in lines[-1]
    assert not (tmp_path / "runs").exists() and not list((tmp_path / "downloads").iterdir())
