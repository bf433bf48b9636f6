"""``kerple-analyze``: figures and the numbers behind them, from one or more checkpoints.

    kerple-analyze kernels          --path A.pt B.pt [--max-distance 2048]
    kerple-analyze effective-length --path A.pt B.pt [--max-distance 20480] [--threshold -2]
    kerple-analyze position-wise    DATA --path A.pt B.pt --length 2048 [--windowed-reference]
    kerple-analyze receptive-field  DATA --path A.pt B.pt --length 2048 [--num-segments 32] [--mass 0.99]
    kerple-analyze attention        DATA --path A.pt B.pt --length 2048 [--num-segments 4]
    kerple-analyze forget-gates     --path FOX.pt [--length 64] [--num-examples 100]
    kerple-analyze compare          --path A.npz B.npz [--protocol P] [--lengths L ...] [--samples 1000]
    kerple-analyze extrapolation    --path A.json B.json [--train-length L]

``compare`` and ``extrapolation`` take several training runs (seeds) of a model under one label:
``--path a1 a2 b1 b2 --labels A A B B``.

Each writes ``<out>/<analysis>.csv`` (and ``receptive-field.json``, ``forget-gates.json``) and, with matplotlib
installed (the ``plots`` extra), ``<out>/<analysis>.png`` (``forget-gates`` draws none); ``compare`` reads the files of
``kerple-eval-lm --per-token`` and writes ``<out>/compare.json``, ``extrapolation`` reads those of
``--results-json``: neither runs a model.
"""

import argparse
import sys

from kerple_fairseq.analysis.commands import (attention, compare, effective_length, extrapolation, forget_gates,
                                              kernels, position_wise, receptive_field)
from kerple_fairseq.analysis.commands.shared import PROG, check_arguments
from kerple_fairseq.errors import KernelConfigError, UsageError

#: each subcommand, in the order of the help
ANALYSES = {
    "kernels": kernels.COMMAND,
    "effective-length": effective_length.COMMAND,
    "position-wise": position_wise.COMMAND,
    "receptive-field": receptive_field.COMMAND,
    "attention": attention.COMMAND,
    "forget-gates": forget_gates.COMMAND,
    "compare": compare.COMMAND,
    "extrapolation": extrapolation.COMMAND,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    sub = parser.add_subparsers(dest="analysis", required=True, metavar="ANALYSIS")
    for name, command in ANALYSES.items():
        command.add_parser(sub, name)
    return parser


def cli_main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    command = ANALYSES[args.analysis]
    try:
        labels = check_arguments(args, command)
        command.run(args, labels, args.out)
    except (UsageError, KernelConfigError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    cli_main()
