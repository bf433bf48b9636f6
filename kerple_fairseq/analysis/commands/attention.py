"""``kerple-analyze attention``: each layer's mean attention weight on the key d tokens back, over the first
segments of a data-bin's split, for methods whose recency comes from the content (stick-breaking,
selective attention); writes ``attention.csv``, ``attention.json`` and ``attention.png``."""

import os

from kerple_fairseq.analysis import figures
from kerple_fairseq.analysis.attention_by_distance import attention_by_distance
from kerple_fairseq.analysis.commands.shared import Command, checkpoint_inputs, data_inputs, draw, load_for_data
from kerple_fairseq.analysis.output_files import write_csv, write_json
from kerple_fairseq.errors import UsageError
from kerple_fairseq.evaluation.cli import positive_int
from kerple_fairseq.evaluation.loading import token_stream


def add_parser(subcommands, name: str) -> None:
    parser = subcommands.add_parser(name, parents=[checkpoint_inputs(), data_inputs()],
                                    help="each layer's mean attention weight on the key d tokens back (stick-breaking, "
                                    "selective attention: recency from the content)")
    parser.add_argument("--num-segments", type=positive_int, default=4,
                        help="the split's first segments of L tokens averaged (default: 4)")


def run(args, labels, out: str) -> None:
    rows, panels, summary = [], [], {}
    for path, label in zip(args.path, labels):
        model, task, _, device = load_for_data(args, path)
        stream = token_stream(task, args.data, args.gen_subset)
        try:
            found = attention_by_distance(model, stream, args.length, args.num_segments, args.max_tokens, device,
                                          progress=not args.no_progress_bar)
        except ValueError as e:
            raise UsageError(str(e)) from e
        layers, heads, _ = found.weights.shape
        for layer in range(layers):
            for head in range(heads):
                rows.extend((label, layer + 1, head + 1, d, repr(float(w)))
                            for d, w in enumerate(found.weights[layer, head]))
        per_layer = found.mean_distance.mean(axis=1)
        summary[label] = {"checkpoint": path, "length": args.length, "segments": found.num_segments,
                          "mean_attended_distance": found.mean_distance.tolist()}
        panels.append((label, found.weights.mean(axis=1), [f"layer {n + 1}" for n in range(layers)]))
        print(f"{label}: mean attended distance by layer (of {args.length} tokens, {found.num_segments} segments): "
              + ", ".join(f"{d:.1f}" for d in per_layer))
    write_csv(os.path.join(out, "attention.csv"), ["model", "layer", "head", "distance", "weight"], rows)
    write_json(os.path.join(out, "attention.json"), summary)
    png = os.path.join(out, "attention.png")
    draw(lambda: figures.attention_by_distance(panels, args.length, png), png)


COMMAND = Command(add_parser, run)
