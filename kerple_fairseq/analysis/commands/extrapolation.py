"""``kerple-analyze extrapolation``: perplexity against evaluation length, a line per model (the mean of
its training runs, with their range) and a panel per protocol, from ``kerple-eval-lm --results-json``
files; writes ``extrapolation.csv`` and ``extrapolation.png``."""

import json
import os
from typing import List

import numpy as np

from kerple_fairseq.analysis import figures
from kerple_fairseq.analysis.commands.shared import Command, draw, inputs, seed_runs
from kerple_fairseq.analysis.output_files import write_csv
from kerple_fairseq.errors import UsageError
from kerple_fairseq.evaluation.cli import positive_int
from kerple_fairseq.evaluation.spans import PROTOCOLS


def add_parser(subcommands, name: str) -> None:
    results_files = inputs("file", "kerple-eval-lm --results-json files, one per model", "extrapolation.csv and .png",
                           seeds=True)
    parser = subcommands.add_parser(name, parents=[results_files],
                                    help="perplexity against evaluation length, one line per model "
                                    "and a panel per protocol, from kerple-eval-lm --results-json files")
    parser.add_argument("--train-length", type=positive_int, metavar="L",
                        help="the training length to mark (default: the one each file records)")


def read_results(path: str) -> List[dict]:
    """The records of a ``kerple-eval-lm --results-json`` file."""
    try:
        with open(path) as f:
            records = json.load(f)
        if not isinstance(records, list) or not all({"protocol", "length", "ppl"} <= set(r) for r in records):
            raise ValueError("not a list of protocol, length and ppl records")
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file") from None
    except (OSError, ValueError, TypeError) as e:
        raise UsageError(f"{path} is not a kerple-eval-lm --results-json file ({e})") from None
    if not records:
        raise UsageError(f"{path} holds no results")
    return records


def run(args, labels, out: str) -> None:
    results = [read_results(path) for path in args.path]
    train_lengths = [args.train_length] if args.train_length else sorted(
        {r["train_length"] for records in results for r in records if r.get("train_length")})
    protocols = [p for p in PROTOCOLS if any(r["protocol"] == p for records in results for r in records)]
    rows, series = [], []
    for label, indices in seed_runs(labels).items():
        for protocol in protocols:
            by_length = {}
            for i in indices:
                for r in results[i]:
                    if r["protocol"] == protocol:
                        by_length.setdefault(r["length"], []).append(r["ppl"])
            lengths = sorted(n for n, ppl in by_length.items() if len(ppl) == len(indices))  # every run has them
            if lengths:
                ppl = [by_length[n] for n in lengths]
                series.append((label, protocol, lengths, [float(np.mean(p)) for p in ppl],
                               [min(p) for p in ppl], [max(p) for p in ppl]))
                rows.extend((label, protocol, n, repr(float(np.mean(p))), repr(min(p)), repr(max(p)), len(p))
                            for n, p in zip(lengths, ppl))
                runs = f" (mean of {len(indices)} runs)" if len(indices) > 1 else ""
                print(f"{label}: {protocol}{runs} " + ", ".join(f"L={n} {np.mean(p):.2f}" for n, p in zip(lengths, ppl)))
    write_csv(os.path.join(out, "extrapolation.csv"), ["model", "protocol", "length", "ppl", "min", "max", "runs"], rows)
    png = os.path.join(out, "extrapolation.png")
    draw(lambda: figures.extrapolation(series, protocols, train_lengths, png), png)


COMMAND = Command(add_parser, run, seed_runs=True)
