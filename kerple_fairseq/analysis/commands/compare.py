"""``kerple-analyze compare``: each model's perplexity difference to the first, with its paired-bootstrap
confidence interval, at every protocol and length its ``kerple-eval-lm --per-token`` files share, and
the spread of the differences over training runs (seeds); writes ``compare.json``."""

import os
import sys

from kerple_fairseq.analysis import significance
from kerple_fairseq.analysis.commands.shared import PROG, Command, inputs, seed_runs
from kerple_fairseq.analysis.output_files import write_json
from kerple_fairseq.errors import UsageError
from kerple_fairseq.evaluation import per_token
from kerple_fairseq.evaluation.cli import positive_int
from kerple_fairseq.evaluation.spans import PROTOCOLS


def add_parser(subcommands, name: str) -> None:
    per_token_files = inputs("file", "kerple-eval-lm --per-token files of one split; the first is the baseline",
                             "compare.json", seeds=True)
    parser = subcommands.add_parser(name, parents=[per_token_files],
                                    help="perplexity differences to the first model, with paired-bootstrap "
                                    "confidence intervals, from kerple-eval-lm --per-token files")
    parser.add_argument("--protocol", choices=PROTOCOLS, help="only this protocol (default: all the files share)")
    parser.add_argument("--lengths", type=positive_int, nargs="+", metavar="L",
                        help="only these lengths (default: all the files share)")
    parser.add_argument("--samples", type=positive_int, default=1000, help="bootstrap samples (default: 1000)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the bootstrap draws (default: 1)")
    parser.add_argument("--confidence", type=float, default=0.95, help="interval level (default: 0.95)")


def check(args) -> None:
    if not 0 < args.confidence < 1:
        raise UsageError(f"--confidence must be between 0 and 1, got {args.confidence}")


def run(args, labels, out: str) -> None:
    files = [per_token.load(p) for p in args.path]
    for label, f in zip(labels[1:], files[1:]):
        if (f.split, f.fingerprint) != (files[0].split, files[0].fingerprint):
            raise UsageError(f"{label} scored split {f.split!r} ({f.fingerprint}) and {labels[0]} split "
                             f"{files[0].split!r} ({files[0].fingerprint}): compare files of the same split")
    shared = set.intersection(*(set(f.scored) for f in files))
    chosen = sorted((k for k in shared if (args.protocol is None or k[0] == args.protocol)
                     and (args.lengths is None or k[1] in args.lengths)),
                    key=lambda k: (PROTOCOLS.index(k[0]), k[1]))
    if not chosen:
        raise UsageError("the files share no protocol and length" + ("" if args.protocol is None and
                         args.lengths is None else " among those asked for"))
    runs = seed_runs(labels)
    models, num_runs = list(runs), len(next(iter(runs.values())))
    comparisons, spreads = [], []
    for protocol, length in chosen:
        per_run = [significance.compare(protocol, length, models,
                                        [files[runs[m][k]].scored[(protocol, length)] for m in models],
                                        args.samples, args.seed, args.confidence, replicate=k + 1)
                   for k in range(num_runs)]
        for c in per_run:
            print(significance.format_comparison(c, num_runs))
        comparisons += [c.as_dict() for c in per_run]
        if num_runs > 1:
            spread = significance.across_seeds(per_run)
            print(significance.format_seed_spread(spread))
            spreads.append(spread.as_dict())
    write_json(os.path.join(out, "compare.json"), {"comparisons": comparisons, "across_seeds": spreads})
    print(f"{PROG}: wrote {os.path.join(out, 'compare.json')}", file=sys.stderr)


COMMAND = Command(add_parser, run, seed_runs=True, check=check)
