"""``kerple-analyze effective-length``: each head's effective length, the smallest distance at which its
bias falls below a threshold, and how many heads have reached it by each distance x (KERPLE A.5);
writes ``effective-length.csv`` and ``effective-length.png``."""

import os

import numpy as np

from kerple_fairseq.analysis import figures
from kerple_fairseq.analysis.commands.shared import Command, checkpoint_inputs, draw, layer_inputs, load_kernels
from kerple_fairseq.analysis.kernel_curves import effective_lengths, heads_within
from kerple_fairseq.analysis.output_files import write_csv
from kerple_fairseq.evaluation.cli import positive_int


def add_parser(subcommands, name: str) -> None:
    parser = subcommands.add_parser(name, parents=[checkpoint_inputs(), layer_inputs()],
                                    help="heads whose bias falls below the threshold by distance x (KERPLE A.5)")
    parser.add_argument("--max-distance", type=positive_int, default=20480,
                        help="x runs over 0..max-distance (default: 20480, as in KERPLE Fig. 6)")
    parser.add_argument("--threshold", type=float, default=-2.0,
                        help="effective length = smallest d with B_h(d) < threshold (default: -2)")


def run(args, labels, out: str) -> None:
    xs = np.arange(args.max_distance + 1)
    rows, series, counts = [], [], []
    for ck in load_kernels(args, labels):
        lengths = effective_lengths(ck.curves(args.max_distance), args.threshold)
        series.append((ck.label, lengths))
        counts.append(heads_within(lengths, xs))
        rows.extend((ck.label, ck.name, layer, head, "" if n is None else n)
                    for (layer, head), n in zip(ck.curve_keys(), lengths))
        print(f"{ck.label}: effective lengths (B < {args.threshold:g}) "
              + ", ".join("> max" if n is None else str(n) for n in lengths))
    write_csv(os.path.join(out, "effective-length.csv"), ["model", "kernel", "layer", "head", "effective_length"], rows)
    png = os.path.join(out, "effective-length.png")
    draw(lambda: figures.effective_length(series, xs, counts, args.threshold, png), png)


COMMAND = Command(add_parser, run)
