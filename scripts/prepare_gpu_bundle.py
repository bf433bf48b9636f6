#!/usr/bin/env python
"""Prepare the bundle that scripts/gpu-check.sh installs on a GPU machine without network.

It holds wheels of the packages the GPU machine lacks (for its Python 3.12 on x86-64 Linux), fairseq's
among them built here by a Python of the GPU image's versions (--builder; scripts/gpu-check.sh
--rehearse makes one in .gpu-rehearsal/), the WikiText-103 sample and a manifest of their SHA-256
sums. Only what is missing or of another version is fetched or built. See docs/gpu.md.
"""

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the checkout's gpu_tools (deployment tooling, not installed)

from gpu_tools.bundle import BundleError, find_sample, prepare, verify  # noqa: E402

PROG = "prepare-gpu-bundle"
REHEARSAL_PYTHON = REPO / ".gpu-rehearsal" / "bin" / "python"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, default=REPO / "gpu-bundle", help="where (default: gpu-bundle/)")
    p.add_argument("--sample", type=Path, help="the WikiText-103 sample (default: $KERPLE_WIKITEXT_DIR, "
                   "../shared/data/wikitext-103-sample or downloads/wikitext-103-sample)")
    p.add_argument("--builder", help="the Python that builds fairseq's wheel: Python 3.12 with the GPU image's torch "
                   "and numpy (default: .gpu-rehearsal/bin/python, where it exists)")
    return p.parse_args(argv)


def log(message):
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def main(argv=None):
    args = parse_args(argv)
    builder = args.builder or (str(REHEARSAL_PYTHON) if REHEARSAL_PYTHON.exists() else None)
    try:
        prepare(args.bundle, args.sample or find_sample(REPO), builder, log=log)
        manifest = verify(args.bundle)
    except BundleError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        sys.exit(1)
    size = sum(f.stat().st_size for f in args.bundle.rglob("*") if f.is_file())
    log(f"{args.bundle}: {len(manifest['packages'])} packages and the sample, {size / 2 ** 20:.1f} MiB, verified")


if __name__ == "__main__":
    main()
