#!/usr/bin/env python
"""How exactly each attention backend (explicit, sdpa, flex) forms the biased logits in fp16 and bf16:
the largest error against float64 per kernel and length (kerple_fairseq/experiments/logit_precision.py).

    python scripts/logit_precision.py                       # every kernel at 2048, 8192 and 16384
    python scripts/logit_precision.py --kernels alibi --lengths 512
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kerple_fairseq.experiments.logit_precision import table  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernels", nargs="*", default=[], help="bias kernels (default: every one but none)")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 16384])
    args = p.parse_args(argv)
    print(table(args.kernels, args.lengths))


if __name__ == "__main__":
    main()
