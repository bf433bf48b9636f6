#!/usr/bin/env python
"""The retrieval comparison on CPU: the position encodings trained alike on multi-query associative recall,
passkey retrieval and copying, their answers' accuracy measured from 1x to 32x the training length, and the
retrieval board (``retrieval-board.{md,csv,png}``) written in ``--out``.

The examples are drawn from a seed: nothing is downloaded or preprocessed. Finished trainings and evaluations
are recorded in their run's directory: run again, the same command goes on where it stopped, and it prints
what the runs left will cost once one has been made.
"""

import argparse
import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's kerple_fairseq

from kerple_core.kernels.constraints import PARAMETERIZATIONS  # noqa: E402
from kerple_fairseq.errors import UsageError  # noqa: E402
from kerple_fairseq.experiments.comparison import CommandFailed  # noqa: E402
from kerple_fairseq.experiments.position_encodings import POSITION_ENCODINGS  # noqa: E402
from kerple_fairseq.experiments.retrieval_comparison import SETTINGS, compare, map_tasks  # noqa: E402
from kerple_fairseq.tasks.retrieval import MIXES  # noqa: E402
from kerple_fairseq.tasks.retrieval_sequences import TASKS  # noqa: E402


PERPLEXITY_BOARD = REPO / "results" / "leaderboard"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / "runs" / "retrieval-comparison",
                   help="checkpoints, logs, results and the board (default: runs/retrieval-comparison)")
    p.add_argument("--models", nargs="+", choices=[*POSITION_ENCODINGS, "all"], default=["all"],
                   help="the models, alike but for their position encoding (default: all, the perplexity board's); "
                   "ALiBi among them is the reference of the paired comparisons")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="training seeds (default: 1 2 3)")
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS), help="trained in turn, each evaluated")
    p.add_argument("--train-task-mix", choices=MIXES, default="turns",
                   help="the training examples' tasks (the retrieval task's option; default: turns, which reached the "
                   "criterion where equal-loss did not: docs/retrieval.md)")
    p.add_argument("--train-length", type=int, default=64, help="tokens per training example (default: 64)")
    p.add_argument("--eval-lengths", type=int, nargs="+",
                   help="evaluation lengths (default: 1x, 2x, 4x ... 32x the training length)")
    p.add_argument("--examples", type=int, default=100, help="validation examples of each task at each length "
                   "(default: 100)")
    p.add_argument("--map-examples", type=int, default=500, help="examples of MQAR and the passkey at each length "
                   "for the depth map, through the depth bands in turn (default: 500, 100 a band)")
    p.add_argument("--depth-bands", type=int, default=5, help="the depth map's bands of where a needle lies "
                   "(default: 5)")
    p.add_argument("--updates", type=int, default=12000, help="the most training updates of a model: one that has "
                   "not learned the tasks by then is listed as not learned (default: 12000)")
    p.add_argument("--check-every", type=int, default=500, help="updates between two checks of whether a model has "
                   "learned the tasks (default: 500)")
    p.add_argument("--criterion", type=float, default=0.97, help="the whole-answer accuracy at the training length "
                   "every task must reach on held-out examples for a model to have learned the tasks (default: 0.97)")
    p.add_argument("--check-examples", type=int, default=100, help="held-out examples of each task at each check "
                   "(the test split: the board's are the validation split's; default: 100)")
    p.add_argument("--max-tokens", type=int, default=2048, help="tokens per update")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kernel-parameterization", choices=PARAMETERIZATIONS, default="clamp",
                   help="how KERPLE-log's parameters stay positive (default: clamp, KERPLE's reference)")
    p.add_argument("--perplexity-board", type=Path, default=PERPLEXITY_BOARD, metavar="DIR",
                   help="a perplexity board's --out: each model's rank there is shown beside its accuracy, and its "
                   "runs' relative costs scale the estimate (default: results/leaderboard)")
    p.add_argument("--board-only", action="store_true",
                   help="write the board and its depth map from the runs of --models and --seeds already trained and "
                   "evaluated in --out, training and evaluating nothing: the board of a comparison still under way")
    return p.parse_args(argv)


def fail(message):
    print(f"retrieval_comparison: error: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv=None):
    args = parse_args(argv)
    if "all" in args.models:
        if args.models != ["all"]:
            fail("--models all stands alone: it names every model")
        args.models = list(POSITION_ENCODINGS)
    for option, values in (("--models", args.models), ("--seeds", args.seeds), ("--tasks", args.tasks)):
        if len(set(values)) != len(values):
            fail(f"{option} names one twice")
    if args.eval_lengths is None:
        args.eval_lengths = [args.train_length * 2 ** k for k in range(6)]
    if any(n <= 0 for n in [args.train_length, args.updates, args.examples, args.max_tokens, args.check_every,
                            args.check_examples, args.map_examples, args.depth_bands, *args.eval_lengths]):
        fail("--train-length, --eval-lengths, --examples, --updates, --check-every, --check-examples, "
             "--map-examples, --depth-bands and --max-tokens must be positive")
    if not 0.0 < args.criterion <= 1.0:
        fail(f"--criterion is a share of whole answers, above 0 and at most 1, got {args.criterion}")
    shortest = max(SETTINGS.shortest(task) for task in args.tasks)
    if min(args.train_length, *args.eval_lengths) < shortest:
        fail(f"--train-length and --eval-lengths must be {shortest} or more: the longest of these tasks' examples needs "
             "that many tokens")
    banded = replace(SETTINGS, depth_bands=args.depth_bands)  # the depth map's: room for a needle in every band
    mapped = map_tasks(args)
    if mapped and min(args.eval_lengths) < max(banded.shortest(task) for task in mapped):
        fail(f"--eval-lengths must be {max(banded.shortest(task) for task in mapped)} or more for the depth map: "
             f"{', '.join(mapped)} need room for a needle in each of --depth-bands {args.depth_bands}")
    if mapped and args.map_examples < args.depth_bands:
        fail(f"--map-examples {args.map_examples} leaves some of --depth-bands {args.depth_bands} empty: give as many "
             "examples as bands or more")
    if args.max_tokens < args.train_length:
        fail(f"--max-tokens {args.max_tokens} holds no example of --train-length {args.train_length}")
    if not args.perplexity_board.is_dir():
        if args.perplexity_board != PERPLEXITY_BOARD:
            fail(f"--perplexity-board {args.perplexity_board} is not a directory: give a perplexity board's --out")
        args.perplexity_board = None  # a checkout without the committed board
    try:
        compare(args)
    except (CommandFailed, UsageError) as e:
        fail(str(e))


if __name__ == "__main__":
    main()
