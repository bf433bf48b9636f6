#!/usr/bin/env python
"""Cost of the bias kernels: training-step and evaluation time and memory against no bias.

In one process, builds the same tiny language model with each kernel, with ``none`` (stock
fairseq ``transformer_lm`` without positions: the causal mask alone, as fairseq builds it) and
with ``sinusoidal`` (stock ``transformer_lm``), and times, at each length, training steps
(forward + backward on a batch of ``--batch-tokens``) and evaluation forwards. Rounds visit
every model in turn (starting one model later each round), and a model's ratio to the
``--baseline`` (``none``) is the median over rounds of its time divided by the baseline's in the
same round, so slow drift on a shared machine cancels; times are medians over the ``--repeats``
rounds. ``KERNEL@BACKEND`` names the kernel's model with ``--attention-backend BACKEND`` (e.g.
``alibi@flex``, ``alibi@sdpa``; without it, ``auto``); the run ends with the number of
FlexAttention compiles and the time spent in the calls that compiled.

Peak memory of one evaluation forward at each ``--memory-lengths``: on the CPU in a fresh child
process per model (peak RSS above the RSS before the forward, the peak reset just before it); on
CUDA in this process, after one untimed forward (max allocated above the allocation before it,
and that forward's tokens/s). On CUDA each timed row also gives the peak memory of the model's first,
untimed step at its length, and its ratio to the baseline's.

    python scripts/benchmark.py            # the full tables (about 15 minutes on 2 CPU cores)
    python scripts/benchmark.py --quick    # a smaller table (under 2 minutes)
    # KERPLE's Table 4 setting: the 247M model in fp16 against stock sinusoidal positions (a GPU)
    python scripts/benchmark.py --wiki103 --fp16 --baseline sinusoidal --batch-tokens 9216 \
        --models alibi kerple_log kerple_power t5 --lengths 512 2048 --memory-lengths 8192 16384 --generate
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kerple_fairseq.experiments.benchmark import ADDED_METHODS, DEFAULT_MODELS, PHASES, WIKITEXT_103_VOCAB, run  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--models", nargs="+", default=DEFAULT_MODELS,
                   help="none, sinusoidal and any --bias-kernel name, which +METHOD may follow for a method over "
                   f"it ({', '.join('+' + m for m in ADDED_METHODS if m)}), e.g. alibi+dape, none+stick-breaking; "
                   "then optionally @BACKEND for "
                   "--attention-backend BACKEND, e.g. alibi@flex, alibi@sdpa, and /OPTION=VALUE for a model option "
                   "of its own, e.g. alibi+dape/cpu-attention-block-scores=0 (default: %(default)s)")
    p.add_argument("--baseline", default="none", help="the model the ratios divide by (added to --models if "
                   "missing; default: none)")
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048], help="sequence lengths timed")
    p.add_argument("--phases", nargs="+", choices=list(PHASES), default=list(PHASES),
                   help="what is timed at each length: training steps, evaluation forwards (default: both)")
    p.add_argument("--batch-tokens", type=int, default=4096, help="tokens per batch (batch = tokens / length)")
    p.add_argument("--repeats", type=int, default=7, help="timed rounds per model and length (median reported)")
    p.add_argument("--memory-lengths", type=int, nargs="*", default=[2048, 4096, 8192],
                   help="lengths of the one-sequence evaluation forwards whose peak memory is measured; with "
                   "three or more, a quadratic fit estimates the longest sequence that fits in --memory-budget")
    p.add_argument("--memory-budget", type=float, default=16.0, help="GiB for that estimate (default: 16)")
    p.add_argument("--generate", type=int, nargs="*", default=[1024, 4096, 16384], metavar="N",
                   help="generate max(N) tokens one at a time with ALiBi, with and without --max-cache-window, "
                   "and report tokens/s over the first N of each")
    p.add_argument("--max-cache-window", type=int, default=1024, help="the trimmed cache of --generate")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=None,
                   help=f"vocabulary size (default: 8000; with --wiki103, WikiText-103's {WIKITEXT_103_VOCAB})")
    p.add_argument("--wiki103", action="store_true",
                   help="ALiBi's WikiText-103 model (transformer_lm_wiki103: 16 layers, width 1024, 8 heads, adaptive "
                   "input and softmax, ~247M parameters) instead of --layers, --width, --heads")
    p.add_argument("--fp16", action="store_true", help="models in half precision (as fairseq's --fp16 runs them)")
    p.add_argument("--model-args", nargs=argparse.REMAINDER, default=[],
                   help="more model options for every plugin model, e.g. --attn-window 128 (last)")
    p.add_argument("--quick", action="store_true",
                   help="CI size: lengths 128 256, 3 rounds, memory at 2048 only, alibi and kerple_log")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after the timing, profile one step of each phase per model at the longest length and "
                   "print its N most costly CUDA kernels (on a CPU, operators) with their shares, then when the "
                   "host's call returns and when the step ends (on a GPU with the operations that made the host "
                   "wait) (default: off)")
    p.add_argument("--cpu", action="store_true", help="stay on the CPU where CUDA is available")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--measure-memory", nargs=2, metavar=("MODEL", "LENGTH"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.profile < 0:
        p.error(f"--profile must be >= 0 (kernels listed per step; 0: no profile), got {args.profile}")
    for name in ("lengths", "memory_lengths"):
        if any(length < 1 for length in getattr(args, name)):
            p.error(f"--{name.replace('_', '-')} must be token counts >= 1, got {getattr(args, name)}")
    for name in ("batch_tokens", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.quick:
        args.models = [m for m in DEFAULT_MODELS if m in ("none", "sinusoidal", "alibi", "kerple_log")]
        args.lengths, args.repeats, args.memory_lengths, args.batch_tokens = [128, 256], 3, [2048], 2048
        args.generate, args.max_cache_window = [256, 512], 128
    return args


def main(argv=None):
    run(parse_args(argv))


if __name__ == "__main__":
    main()
