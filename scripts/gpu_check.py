#!/usr/bin/env python
"""The GPU checks in one bounded command, on a machine with a CUDA GPU and no network.

Steps, in order, each within its share of --budget (seconds: {shares};
a step that ends early leaves its time to the next, one that overruns is cut and the next started):
the machine; what the environment lacks of the bundle, nothing it holds changed; the CUDA test tier;
the fused attention kernel alone against flash attention, then KERPLE Table 4's speed; a short fp16 training of the 247M model (alibi, kerple_log); kerple-eval-lm
--fp16 of both. The results folder gets gpu-check.log, gpu-check.json (rewritten after every step) and
cuda-tests.xml. See docs/gpu.md.

    bash scripts/gpu-check.sh --results DIR     # on the GPU machine, gpu-bundle/ carried in the checkout
    bash scripts/gpu-check.sh --rehearse        # here: every step on the GPU image's stack minus CUDA
    bash scripts/gpu-check.sh --dry-run         # anywhere: check the bundle, print the commands
"""

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the checkout's gpu_tools (deployment tooling, not installed)

from gpu_tools.check import SHARES, STEPS, Paths, check  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="gpu-check", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1].format(
                                    shares=", ".join(f"{step} {seconds}" for step, seconds in SHARES.items())))
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--rehearse", action="store_true",
                      help="without a GPU, in an environment of the GPU image's versions: every step, the CUDA "
                      "tier skipped and the rest at CPU size (scripts/gpu-check.sh makes the environment)")
    mode.add_argument("--dry-run", action="store_true",
                      help="without a GPU: prepare and check the bundle (fairseq's wheel only with --builder), "
                      "print every command, run the parts that need no GPU")
    p.add_argument("--bundle", type=Path, default=REPO / "gpu-bundle", help="the bundle (default: gpu-bundle/)")
    p.add_argument("--results", type=Path, default=REPO / "gpu-results",
                   help="gpu-check.log, gpu-check.json and cuda-tests.xml go here (default: gpu-results/)")
    p.add_argument("--work", type=Path, default=Path("/tmp/kerple-gpu-check"),
                   help="data-bin, checkpoints and other files of the steps (default: %(default)s)")
    p.add_argument("--budget", type=float, default=sum(SHARES.values()),
                   help="seconds for the whole command, enforced (default: %(default)s)")
    p.add_argument("--builder", help="a Python of the GPU image's versions that builds fairseq's wheel (default in "
                   "a rehearsal: its own)")
    later = [s for s in STEPS if s not in ("preflight", "install")]
    p.add_argument("--steps", nargs="+", choices=later, default=later,
                   help="the steps after preflight and install (default: all)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    mode = "rehearse" if args.rehearse else "dry-run" if args.dry_run else "gpu"
    builder = args.builder or (sys.executable if args.rehearse else None)
    paths = Paths(repo=REPO, bundle=args.bundle.resolve(), results=args.results.resolve(), work=args.work.resolve())
    sys.exit(check(paths, mode, args.steps, args.budget, builder))


if __name__ == "__main__":
    main()
