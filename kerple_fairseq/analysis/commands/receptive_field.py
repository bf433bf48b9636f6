"""``kerple-analyze receptive-field``: each model's cumulative normalized gradient over the most recent
tokens and its empirical receptive field, beside the theoretical one of a windowed model (Sandwich
§5.1); writes ``receptive-field.csv``, ``receptive-field.json`` and ``receptive-field.png``."""

import os

from kerple_fairseq.analysis import figures
from kerple_fairseq.analysis.commands.shared import Command, checkpoint_inputs, data_inputs, draw, load_for_data
from kerple_fairseq.analysis.output_files import write_csv, write_json
from kerple_fairseq.analysis.receptive_field import receptive_field, theoretical_receptive_field
from kerple_fairseq.errors import UsageError
from kerple_fairseq.evaluation.cli import positive_int
from kerple_fairseq.evaluation.loading import token_stream


def add_parser(subcommands, name: str) -> None:
    parser = subcommands.add_parser(name, parents=[checkpoint_inputs(), data_inputs()],
                                    help="cumulative normalized gradient and ERF (Sandwich §5.1)")
    parser.add_argument("--num-segments", type=positive_int, default=32,
                        help="segments averaged, evenly spread over the split (default: 32)")
    parser.add_argument("--mass", type=float, default=0.99,
                        help="ERF = fewest most recent tokens holding more than this share (default: 0.99)")


def check(args) -> None:
    if not 0 < args.mass < 1:
        raise UsageError(f"--mass must be between 0 and 1, got {args.mass}")


def run(args, labels, out: str) -> None:
    rows, series, summary = [], [], {}
    for path, label in zip(args.path, labels):
        model, task, _, device = load_for_data(args, path)
        stream = token_stream(task, args.data, args.gen_subset)
        try:
            field = receptive_field(model, stream, args.length, args.num_segments, args.mass, args.max_tokens, device,
                                    progress=not args.no_progress_bar)
        except ValueError as e:
            raise UsageError(str(e)) from e
        attention_bias = getattr(model.decoder, "attention_bias", None)
        window = attention_bias.attention_window if attention_bias is not None else 0
        theoretical = theoretical_receptive_field(window, len(model.decoder.layers))
        summary[label] = {"checkpoint": path, "length": args.length, "segments": args.num_segments, "mass": args.mass,
                          "erf": field.erf, "support": field.support, "window": window,
                          "layers": len(model.decoder.layers), "theoretical_receptive_field": theoretical}
        cumulative = field.cumulative
        rows.extend((label, k + 1, repr(float(field.shares[k])), repr(float(cumulative[k]))) for k in range(args.length))
        series.append((label, cumulative, field.erf))
        print(f"{label}: ERF {field.erf} of {args.length} tokens (mass {args.mass}, {args.num_segments} segments); "
              f"gradient reaches {field.support} tokens"
              + (f"; theoretical receptive field {theoretical}" if theoretical else ""))
    write_csv(os.path.join(out, "receptive-field.csv"), ["model", "recent_tokens", "share", "cumulative"], rows)
    write_json(os.path.join(out, "receptive-field.json"), summary)
    png = os.path.join(out, "receptive-field.png")
    draw(lambda: figures.receptive_field(series, args.mass, args.length, args.num_segments, png), png)


COMMAND = Command(add_parser, run, check=check)
