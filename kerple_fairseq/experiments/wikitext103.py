"""WikiText-103 on disk: download, verify, unpack, and fairseq-preprocess into a data-bin.

Every step writes to a temporary name and renames when complete, so an
interrupted run leaves nothing a later run could mistake for a finished result.
"""

import hashlib
import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path
from typing import Callable, List, Optional

from kerple_fairseq.experiments.paths import BIN

# fairseq's examples/language_model/prepare-wikitext-103.sh points at
# s3.amazonaws.com/research.metamind.io, which now answers 403; the dataset's author hosts it here.
OFFICIAL_URL = "https://wikitext.smerity.com/wikitext-103-v1.zip"
OFFICIAL_MD5 = "9ddaacaf6af0710eda8c456decff7832"  # wikitext-103-v1.zip (torchtext records the same)
ARCHIVE_NAME = "wikitext-103-v1.zip"
SPLITS = ("train", "valid", "test")
STAMP = "kerple-source.json"
# The small comparison's data: the first 2.5 MiB of the training split (151 articles, 492,503 words,
# the last line cut) with the complete validation and test splits.
SAMPLE_TRAIN_BYTES = 2_621_440
OFFLINE_SOURCES = (f"without network, fetch {ARCHIVE_NAME} elsewhere and pass --archive FILE, or pass "
                   "--tokens-dir DIR holding wiki.{train,valid,test}.tokens")


class PrepareError(Exception):
    """A problem the user can fix; reported as one line."""


def missing_token_files(tokens_dir: Path) -> List[str]:
    """The names of the ``wiki.{train,valid,test}.tokens`` that ``tokens_dir`` lacks."""
    return [f"wiki.{s}.tokens" for s in SPLITS if not (tokens_dir / f"wiki.{s}.tokens").is_file()]


def token_files(tokens_dir: Path) -> dict:
    """The path of each split's ``wiki.<split>.tokens`` in ``tokens_dir``, which must hold all three."""
    missing = missing_token_files(tokens_dir)
    if missing:
        raise PrepareError(f"{tokens_dir} lacks {', '.join(missing)} (expected wiki.{{train,valid,test}}.tokens "
                           "of the wikitext-103-v1 release)")
    return {s: tokens_dir / f"wiki.{s}.tokens" for s in SPLITS}


def require_data_bin(path: Path) -> None:
    """Training and evaluation need a preprocessed data-bin; say how to make one if ``path`` is not."""
    if not (path / "dict.txt").is_file():
        raise PrepareError(f"{path} is not a data-bin (no dict.txt); run: bash scripts/prepare-wikitext-103.sh "
                           f"--dest {path}")


def md5sum(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "md5").hexdigest()


def download(url: str, dest: Path, md5: str, log=print, offline: str = OFFLINE_SOURCES) -> None:
    """Fetch ``url`` into ``dest`` via ``dest.part``; only a complete file with the right md5 is kept.
    ``offline`` ends the message of a failed download: how to do without it."""
    part = dest.with_name(dest.name + ".part")
    log(f"downloading {url}")
    try:
        with urllib.request.urlopen(url, timeout=60) as response, open(part, "wb") as out:
            expected = int(response.headers.get("Content-Length") or 0)
            received, shown = 0, time.time()
            for block in iter(lambda: response.read(1 << 20), b""):
                out.write(block)
                received += len(block)
                if time.time() - shown > 10:
                    total = f" of {expected / 2**20:.0f}" if expected else ""
                    log(f"  {received / 2**20:.0f}{total} MiB")
                    shown = time.time()
        if expected and received != expected:
            raise PrepareError(f"download of {url} stopped after {received} of {expected} bytes; run again")
    except (urllib.error.URLError, OSError) as e:
        part.unlink(missing_ok=True)
        reason = getattr(e, "reason", None) or e
        raise PrepareError(f"cannot download {url} ({reason}); {offline}") from e
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    if md5 and md5sum(part) != md5:
        part.unlink()
        raise PrepareError(f"{url} does not have the expected md5 {md5} (corrupt or a different file); "
                           "nothing was kept. Pass --md5 for a deliberately different archive")
    part.rename(dest)


def archive_tokens(archive: Optional[Path], url: str, md5: str, download_dir: Path,
                   log: Callable[[str], None] = print, offline: str = OFFLINE_SOURCES) -> Path:
    """The unpacked tokens of ``archive``, or of ``download_dir``'s archive, downloaded from ``url`` unless
    already there; they are unpacked into ``download_dir/wikitext-103``."""
    if archive is None:
        archive = download_dir / ARCHIVE_NAME
        if archive.is_file():
            log(f"using the archive already downloaded, {archive}")
        else:
            download_dir.mkdir(parents=True, exist_ok=True)
            download(url, archive, md5, log=log, offline=offline)
    elif not archive.is_file():
        raise PrepareError(f"--archive {archive} does not exist")
    return unpack(archive, download_dir / "wikitext-103", md5)


def unpack(archive: Path, dest: Path, md5: str) -> Path:
    """Extract the archive's ``wiki.*.tokens`` into ``dest`` (via ``dest.partial``); returns ``dest``."""
    if (dest / STAMP).is_file() and json.loads((dest / STAMP).read_text()) == {"archive": str(archive.resolve())}:
        return dest
    if md5 and md5sum(archive) != md5:
        raise PrepareError(f"{archive} does not have the expected md5 {md5}; delete it (or pass --md5) and run again")
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        with zipfile.ZipFile(archive) as z:
            for split in SPLITS:
                name = next((n for n in z.namelist() if n.endswith(f"wiki.{split}.tokens")), None)
                if name is None:
                    raise PrepareError(f"{archive} has no wiki.{split}.tokens; is it wikitext-103-v1.zip?")
                with z.open(name) as src, open(partial / f"wiki.{split}.tokens", "wb") as out:
                    shutil.copyfileobj(src, out, 1 << 20)
    except zipfile.BadZipFile as e:
        raise PrepareError(f"{archive} is not a zip archive ({e}); delete it and run again") from e
    (partial / STAMP).write_text(json.dumps({"archive": str(archive.resolve())}))
    shutil.rmtree(dest, ignore_errors=True)
    partial.rename(dest)
    return dest


def sample(tokens_dir: Path, dest: Path, train_bytes: int = SAMPLE_TRAIN_BYTES) -> Path:
    """``dest`` holding the first ``train_bytes`` of ``tokens_dir``'s training split and its complete
    validation and test splits, written via ``dest.partial`` and reused when made from the same files."""
    files = token_files(tokens_dir)
    stamp = {"source": str(tokens_dir.resolve()), "train_bytes": train_bytes,
             "sizes": {s: p.stat().st_size for s, p in files.items()}}
    if (dest / STAMP).is_file() and json.loads((dest / STAMP).read_text()) == stamp:
        return dest
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    with open(files["train"], "rb") as src:
        (partial / "wiki.train.tokens").write_bytes(src.read(train_bytes))
    for split in ("valid", "test"):
        shutil.copyfile(files[split], partial / f"wiki.{split}.tokens")
    (partial / STAMP).write_text(json.dumps(stamp))
    shutil.rmtree(dest, ignore_errors=True)
    partial.rename(dest)
    return dest


def preprocess(tokens_dir: Path, dest: Path, vocab_size: int = 0, workers: Optional[int] = None, log=print) -> bool:
    """``fairseq-preprocess --only-source`` into ``dest`` via ``dest.partial``, with ``workers`` processes
    (default: one per CPU core).

    A complete earlier result for the same files and vocabulary is reused (returns False);
    a directory this function did not write is never overwritten.
    """
    files = token_files(tokens_dir)
    stamp = {"source": str(tokens_dir.resolve()), "vocab_size": vocab_size,
             "sizes": {s: p.stat().st_size for s, p in files.items()}}
    stamp_file = dest / STAMP
    if stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp:
        log(f"data-bin {dest} is up to date")
        return False
    if dest.exists() and not stamp_file.is_file():
        raise PrepareError(f"{dest} exists but was not written by this script; remove it or choose another destination")
    log(f"preprocessing {tokens_dir} into {dest}")
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    cmd = [str(BIN / "fairseq-preprocess"), "--only-source", "--workers", str(workers or os.cpu_count() or 1), "--destdir", str(partial),
           "--trainpref", str(files["train"]), "--validpref", str(files["valid"]), "--testpref", str(files["test"])]
    if vocab_size:
        cmd += ["--nwordssrc", str(vocab_size)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise PrepareError(f"fairseq-preprocess failed ({tail[0]}); {dest} was left untouched")
    (partial / STAMP).write_text(json.dumps(stamp))
    shutil.rmtree(dest, ignore_errors=True)
    partial.rename(dest)  # complete or absent, never half-written
    return True
