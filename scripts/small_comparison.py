#!/usr/bin/env python
"""The small comparison of position encodings on CPU: preprocess, train small models, evaluate, tabulate.

Reads WikiText-103 ``wiki.{train,valid,test}.tokens`` from ``--wikitext-dir`` (or the
``WIKITEXT103_DIR`` variable); without either it downloads WikiText-103 once into ``downloads/`` and
reads its sample (the first 2.5 MiB of training text, the complete validation and test splits).
It preprocesses them into ``data-bin/``, trains the ``--models``
(by default sinusoidal positions, ALiBi and KERPLE-log) with identical settings on CPU, scores
the validation split with ``kerple-eval-lm`` under the early-token-cursed and last-token
protocols at several lengths, prints a perplexity table (also written as markdown and JSON)
and the leaderboard over the ``--seeds`` (``leaderboard.{md,csv,png}``), and ends with
``kerple-analyze``'s figures: perplexity against length, paired-bootstrap intervals of each
difference to the first model, kernel curves, effective lengths, position-wise perplexity,
receptive field and attention by distance.

Finished trainings and evaluations are recorded in their run's directory: run again, the same
command goes on where it stopped, and a changed option redoes only what it changes.
"""

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's kerple_fairseq

from kerple_fairseq.errors import UsageError  # noqa: E402
from kerple_fairseq.experiments.comparison import CommandFailed  # noqa: E402
from kerple_fairseq.experiments.position_encodings import POSITION_ENCODINGS  # noqa: E402
from kerple_fairseq.experiments.small_comparison import (  # noqa: E402
    ANALYSES, DEFAULT_MODELS, compare, downloaded_sample, stage)
from kerple_core.kernels.constraints import PARAMETERIZATIONS  # noqa: E402
from kerple_fairseq.experiments.wikitext103 import OFFICIAL_URL, PrepareError, missing_token_files  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wikitext-dir", default=os.environ.get("WIKITEXT103_DIR"),
                   help="directory with wiki.{train,valid,test}.tokens (default: $WIKITEXT103_DIR; without "
                   "either, WikiText-103 is downloaded into --download-dir and its sample is read)")
    p.add_argument("--download-dir", type=Path, default=REPO / "downloads",
                   help="where WikiText-103 is downloaded and unpacked when no tokens are given (default: downloads/)")
    p.add_argument("--url", default=OFFICIAL_URL, help=f"where to download it from (default: {OFFICIAL_URL})")
    p.add_argument("--data-bin", type=Path, help="preprocessed output (default: data-bin/<name of the tokens dir>)")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "small-comparison",
                   help="checkpoints, logs and results (default: runs/small-comparison)")
    p.add_argument("--vocab-size", type=int, default=8000,
                   help="keep the most frequent words, the rest become <unk> (CPU cost is dominated by "
                   "the output layer; 0 keeps all)")
    p.add_argument("--train-length", type=int, default=64, help="tokens per training sample (default: 64)")
    p.add_argument("--eval-lengths", type=int, nargs="+",
                   help="evaluation lengths, each under both protocols (default: 1x, 2x, 4x ... 32x the training length)")
    p.add_argument("--num-targets", type=int, default=200, help="targets of the last-token protocol")
    p.add_argument("--num-segments", type=int, default=32,
                   help="segments of the receptive-field analysis (at the largest evaluation length)")
    p.add_argument("--updates", type=int, default=500, help="training updates per model")
    p.add_argument("--max-tokens", type=int, default=2048, help="tokens per update")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seeds", type=int, nargs="+", default=[1],
                   help="train every model once per seed (default: 1); compare then reports the spread over seeds")
    p.add_argument("--models", nargs="+", choices=[*POSITION_ENCODINGS, "all"], default=DEFAULT_MODELS,
                   help=f"the models to train, alike but for their position encoding (default: {' '.join(DEFAULT_MODELS)}; "
                   "all: every one named here); the first is the baseline of the paired comparison")
    p.add_argument("--analyses", nargs="*", choices=ANALYSES, default=list(ANALYSES),
                   help="the kerple-analyze analyses run at the end (default: all; none with an empty list)")
    p.add_argument("--other-length", type=Path, metavar="DIR",
                   help="the --out of the same comparison at another --train-length (e.g. results/leaderboard): its "
                   "records give each model's relative cost for the estimate, its ranking the models kept at every "
                   "seed under --budget-hours, and both-lengths.{md,csv,png} show the two training lengths together")
    p.add_argument("--budget-hours", type=float,
                   help="when the runs left would take longer (estimated after the first run), every seed only for "
                   "--every-seed-for, the top --every-seed-top of --other-length and what they are compared with, "
                   "the first seed for the others; run again with more (or none) to add seeds (default: no budget)")
    p.add_argument("--every-seed-for", nargs="+", default=[], choices=list(POSITION_ENCODINGS), metavar="MODEL",
                   help="models that keep every seed under --budget-hours")
    p.add_argument("--every-seed-top", type=int, default=8,
                   help="the best models at --other-length's longest length (early-token-cursed) that keep every "
                   "seed under --budget-hours (default: 8)")
    p.add_argument("--kernel-parameterization", choices=PARAMETERIZATIONS, default="clamp",
                   help="how KERPLE-log's parameters stay positive: clamp (KERPLE's reference, default) or softplus")
    return p.parse_args()


def fail(message):
    print(f"small_comparison: error: {message}", file=sys.stderr)
    sys.exit(2)


def main():
    args = parse_args()
    if args.wikitext_dir:
        missing = missing_token_files(Path(args.wikitext_dir))
        if missing:
            fail(f"{args.wikitext_dir} lacks {', '.join(missing)}: give a directory with wiki.train.tokens, "
                 "wiki.valid.tokens and wiki.test.tokens (an unpacked wikitext-103-v1.zip), or none to download it")
    if "all" in args.models:
        if args.models != ["all"]:
            fail("--models all stands alone: it names every model")
        args.models = list(POSITION_ENCODINGS)
    if len(set(args.models)) != len(args.models):
        fail("--models names a model twice")
    if len(set(args.seeds)) != len(args.seeds):
        fail("--seeds names a seed twice")
    if args.eval_lengths is None:
        args.eval_lengths = [args.train_length * 2 ** k for k in range(6)]
    if any(n <= 0 for n in [args.train_length, args.updates, args.num_targets, args.num_segments, *args.eval_lengths]):
        fail("--train-length, --updates, --num-targets, --num-segments and --eval-lengths must be positive")
    if args.train_length < 2:
        fail("--train-length must be 2 or more: one token has no other position, and ReRoPE scales queries by "
             "log(i + 1) / log(training length)")
    if args.budget_hours is not None and args.budget_hours <= 0:
        fail("--budget-hours must be positive")
    if args.every_seed_top < 0:
        fail("--every-seed-top must be zero or more")
    if args.other_length is not None and not args.other_length.is_dir():
        fail(f"--other-length {args.other_length} is not a directory: give the --out of a comparison at another "
             "training length")
    if args.other_length is not None and args.other_length.resolve() == args.out.resolve():
        fail("--other-length names --out itself: give the comparison at the other training length")
    try:
        tokens_dir = Path(args.wikitext_dir) if args.wikitext_dir else downloaded_sample(
            args.url, args.download_dir, log=stage)
        compare(args, tokens_dir, args.data_bin or REPO / "data-bin" / tokens_dir.resolve().name)
    except (PrepareError, CommandFailed, UsageError) as e:
        fail(str(e))


if __name__ == "__main__":
    main()
