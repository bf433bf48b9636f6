#!/usr/bin/env python
"""Download WikiText-103 (wikitext-103-v1), verify it, unpack it and preprocess it into a data-bin.

Offline: ``--archive FILE`` (a downloaded wikitext-103-v1.zip) or ``--tokens-dir DIR`` (its
unpacked ``wiki.{train,valid,test}.tokens``). Running it again reuses every finished step.
"""

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's kerple_fairseq

from kerple_fairseq.experiments.wikitext103 import (  # noqa: E402
    ARCHIVE_NAME, OFFICIAL_MD5, OFFICIAL_URL, PrepareError, archive_tokens, preprocess)

PROG = "prepare-wikitext-103"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    source = p.add_mutually_exclusive_group()
    source.add_argument("--url", default=OFFICIAL_URL, help=f"where to download {ARCHIVE_NAME} (default: {OFFICIAL_URL})")
    source.add_argument("--archive", type=Path, help=f"an already downloaded {ARCHIVE_NAME}")
    source.add_argument("--tokens-dir", type=Path, help="a directory with wiki.{train,valid,test}.tokens")
    p.add_argument("--md5", default=OFFICIAL_MD5,
                   help=f"expected md5 of the archive (default: the official {OFFICIAL_MD5}; '' skips the check)")
    p.add_argument("--download-dir", type=Path, default=REPO / "downloads",
                   help="where the archive and its unpacked tokens go (default: downloads/)")
    p.add_argument("--dest", type=Path, default=REPO / "data-bin" / "wikitext-103",
                   help="the data-bin to write (default: data-bin/wikitext-103)")
    p.add_argument("--workers", type=int, default=None,
                   help=f"fairseq-preprocess workers (default: one per CPU core, {os.cpu_count()} here)")
    p.add_argument("--vocab-size", type=int, default=0,
                   help="keep only the most frequent words (default 0: all ~267k types, as in the papers)")
    return p.parse_args(argv)


def log(message):
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def main(argv=None):
    args = parse_args(argv)
    try:
        tokens_dir = args.tokens_dir or archive_tokens(args.archive, args.url, args.md5, args.download_dir, log=log)
        preprocess(tokens_dir, args.dest, args.vocab_size, args.workers, log=log)
    except PrepareError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        sys.exit(1)
    log(f"done: {args.dest} (train with: bash scripts/train-wikitext-103.sh KERNEL --data {args.dest})")


if __name__ == "__main__":
    main()
