#!/usr/bin/env python
"""On a machine with a CUDA GPU and no network: install from the bundle, then run the GPU checks in order.

Steps (each within its time limit, a failure not stopping the next; --steps chooses among them, the
install always runs): install (the bundle, fairseq built against this machine's torch, this checkout),
cuda-tests (pytest -m cuda), data (the WikiText-103 sample), train (fp16, the 247M model, alibi and
kerple_log), eval (kerple-eval-lm --fp16 at 512..3072, both protocols; the kernels), speed (KERPLE
Table 4's setting). Everything is printed and written to RESULTS/gpu-check.log, figures to
RESULTS/gpu-check.json. See docs/gpu.md.

    bash scripts/prepare-gpu-bundle.sh              # first, with access to PyPI: gpu-bundle/
    bash scripts/gpu-check.sh --results DIR         # on the GPU machine
    bash scripts/gpu-check.sh --dry-run             # anywhere: check the bundle, print the commands
"""

import argparse
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# kerple_fairseq/__init__.py imports fairseq, which this command installs: its experiments are
# reached without running that file (the steps start processes of their own, which import it whole)
sys.modules["kerple_fairseq"] = types.ModuleType("kerple_fairseq")
sys.modules["kerple_fairseq"].__path__ = [str(REPO / "kerple_fairseq")]

from kerple_fairseq.experiments.gpu_check import LIMITS, STEPS, Paths, check  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="gpu-check", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--dry-run", action="store_true",
                   help="without a GPU: prepare and check the bundle, print every command, run the parts that "
                   "need no GPU")
    p.add_argument("--bundle", type=Path, default=REPO / "gpu-bundle", help="the bundle (default: gpu-bundle/)")
    p.add_argument("--results", type=Path, default=REPO / "gpu-results",
                   help="gpu-check.log and gpu-check.json go here (default: gpu-results/)")
    p.add_argument("--work", type=Path, default=Path("/tmp/kerple-gpu-check"),
                   help="data-bin, checkpoints and other files of the steps (default: %(default)s)")
    p.add_argument("--steps", nargs="+", choices=[s for s in STEPS if s != "install"],
                   default=[s for s in STEPS if s != "install"],
                   help="the steps after the install (default: all; limits in seconds: "
                   + ", ".join(f"{k} {v}" for k, v in LIMITS.items()) + ")")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    paths = Paths(repo=REPO, bundle=args.bundle.resolve(), results=args.results.resolve(), work=args.work.resolve())
    sys.exit(check(paths, args.dry_run, args.steps))


if __name__ == "__main__":
    main()
