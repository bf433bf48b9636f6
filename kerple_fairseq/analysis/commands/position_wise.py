"""``kerple-analyze position-wise``: each model's mean perplexity by position in blocks of L tokens of a
data-bin's split (KERPLE §5.5), optionally beside the model with attention limited to its training
length; writes ``position-wise.csv`` and ``position-wise.png``."""

import os

import numpy as np

from kerple_fairseq.analysis import figures
from kerple_fairseq.analysis.commands.shared import Command, checkpoint_inputs, data_inputs, draw, load_for_data
from kerple_fairseq.analysis.output_files import write_csv
from kerple_fairseq.analysis.position_wise import binned_perplexity, position_wise_loss
from kerple_fairseq.errors import UsageError
from kerple_fairseq.evaluation.cli import positive_int
from kerple_fairseq.evaluation.loading import token_stream


def add_parser(subcommands, name: str) -> None:
    parser = subcommands.add_parser(name, parents=[checkpoint_inputs(), data_inputs()],
                                    help="mean perplexity by position in blocks of L tokens (KERPLE §5.5)")
    parser.add_argument("--windowed-reference", action="store_true",
                        help="also draw each model with attention limited to its training length")
    parser.add_argument("--reference-window", type=positive_int, metavar="W",
                        help="the reference's window instead of the training length (implies --windowed-reference)")
    parser.add_argument("--bin-width", type=positive_int, metavar="N",
                        help="positions averaged per point of the figure (default: L/64); the CSV has every position")


def run(args, labels, out: str) -> None:
    rows, series, train_lengths = [], [], []
    bin_width = args.bin_width or max(1, args.length // 64)
    for path, label in zip(args.path, labels):
        model, task, train_length, device = load_for_data(args, path)
        stream = token_stream(task, args.data, args.gen_subset)
        train_lengths.append(train_length)
        variants = [(label, None)]
        if args.windowed_reference or args.reference_window:
            if getattr(model.decoder, "attention_bias", None) is None:
                raise UsageError(f"--windowed-reference needs a kerple_fairseq model; {path} is a {type(model).__name__}")
            window = args.reference_window or train_length
            variants.append((f"{label} windowed@{window}", window))
        for name, window in variants:
            attention_bias = getattr(model.decoder, "attention_bias", None)
            trained_window = attention_bias.attention_window if attention_bias is not None else 0
            if window is not None:
                attention_bias.set_attention_window(window)
            try:
                losses, counts = position_wise_loss(model, stream, task.source_dictionary.eos(), args.length,
                                                    args.max_tokens, device, progress=not args.no_progress_bar)
            finally:
                if window is not None:
                    attention_bias.set_attention_window(trained_window)
            rows.extend((name, p, repr(float(losses[p])), repr(2.0 ** float(losses[p])), int(counts[p]))
                        for p in range(args.length) if counts[p])
            centres, ppl = binned_perplexity(losses, counts, bin_width)
            series.append((label, name, 2.0 ** losses, centres, ppl))
            mean = float(np.nansum(losses * counts) / counts.sum())
            print(f"{name}: L = {args.length}, perplexity {2 ** mean:.2f} over {int(counts.sum())} tokens; "
                  f"{ppl[0]:.1f} in the first {bin_width} positions, {ppl[-1]:.1f} in the last")
    write_csv(os.path.join(out, "position-wise.csv"), ["model", "position", "loss", "ppl", "count"], rows)
    png = os.path.join(out, "position-wise.png")
    first = min(args.length, 64)
    draw(lambda: figures.position_wise(series, train_lengths, args.length, bin_width, first, png), png)


COMMAND = Command(add_parser, run)
