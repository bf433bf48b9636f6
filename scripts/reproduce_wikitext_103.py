#!/usr/bin/env python
"""Reproduce KERPLE's Table 10: ALiBi vs KERPLE-log on WikiText-103, trained at 512 (and optionally 2048),
evaluated at 512..3072 under the early-token-cursed and last-token protocols, beside the published numbers.

``--models`` adds the positional baselines (sinusoidal, rotary, NoPE, T5) on the same architecture,
and ``--seeds`` trains every model once per seed.

Trains with ``train_wikitext_103.py`` (ALiBi's recipe, every GPU, fp16) and evaluates with
``kerple-eval-lm``; options it does not know go to fairseq-train (e.g. ``--max-update``).
Finished checkpoints are reused (fairseq resumes an interrupted run from checkpoint_last.pt).
"""

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's kerple_fairseq

from kerple_fairseq.experiments.comparison import CommandFailed  # noqa: E402
from kerple_fairseq.experiments.position_encodings import POSITION_ENCODINGS  # noqa: E402
from kerple_fairseq.experiments.reproduction import TABLE_10_MODELS, reproduce  # noqa: E402
from kerple_fairseq.experiments.wikitext103 import PrepareError, require_data_bin  # noqa: E402

PROG = "reproduce-wikitext-103"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0],
                                epilog="Any other option goes to fairseq-train.")
    p.add_argument("--data", type=Path, default=REPO / "data-bin" / "wikitext-103",
                   help="the data-bin from prepare-wikitext-103.sh (default: data-bin/wikitext-103)")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "reproduce-wikitext-103",
                   help="checkpoints, evaluations and results.md (default: runs/reproduce-wikitext-103)")
    p.add_argument("--models", nargs="+", choices=list(POSITION_ENCODINGS), default=TABLE_10_MODELS,
                   help=f"position encodings on ALiBi's model (default: {' '.join(TABLE_10_MODELS)}, Table 10's)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1],
                   help="train every model once per seed (default: 1, the recipe's)")
    p.add_argument("--train-lengths", type=int, nargs="+", default=[512], help="512, and 2048 optionally")
    p.add_argument("--eval-lengths", type=int, nargs="+", default=[512, 1024, 1536, 2048, 3072])
    p.add_argument("--num-targets", type=int, default=1000, help="targets of the last-token protocol")
    p.add_argument("--tiny", action="store_true", help="the CPU smoke preset of the training script")
    p.add_argument("--cpu-processes", type=int, default=0, help="passed to the training script")
    return p.parse_known_args(argv)


def fail(message):
    print(f"{PROG}: error: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv=None):
    args, extra = parse_args(argv)
    try:
        require_data_bin(args.data)
    except PrepareError as e:
        fail(str(e))
    for option, values in (("--models", args.models), ("--seeds", args.seeds)):
        if len(set(values)) != len(values):
            fail(f"{option} names one twice")
    try:
        reproduce(args, extra, PROG)
    except CommandFailed as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        sys.exit(e.returncode)


if __name__ == "__main__":
    main()
