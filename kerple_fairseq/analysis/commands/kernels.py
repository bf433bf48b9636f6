"""``kerple-analyze kernels``: each head's bias B_h(d) against distance d (KERPLE §5.4), per layer for a
bias of each layer's own (fire, fox), with the kernels' learned parameters; writes ``kernels.csv``,
``kernel-parameters.csv`` where there are learned parameters, and ``kernels.png``."""

import os

from kerple_fairseq.analysis import figures
from kerple_fairseq.analysis.commands.shared import Command, checkpoint_inputs, draw, layer_inputs, load_kernels
from kerple_fairseq.analysis.output_files import write_csv
from kerple_fairseq.evaluation.cli import positive_int


def add_parser(subcommands, name: str) -> None:
    parser = subcommands.add_parser(name, parents=[checkpoint_inputs(), layer_inputs()],
                                    help="each head's bias B_h(d) (KERPLE §5.4); per layer for fire and fox")
    parser.add_argument("--max-distance", type=positive_int, default=2048, help="largest d drawn (default: 2048)")


def panel_title(label: str, kernel: str, attention_window: int, description: str = "") -> str:
    """A checkpoint's label, with its kernel where the label does not name it, its window if any, and
    what its curves show where that needs saying."""
    details = ([] if kernel == label else [f"kernel {kernel}"]) + ([f"window {attention_window}"] if attention_window else [])
    details += [description] if description else []
    return f"{label} ({', '.join(details)})" if details else label


def curve_label(layer, head: int) -> str:
    """``head h``, or ``layer l head h`` for a bias of each layer's own."""
    return f"head {head}" if layer == "" else f"layer {layer} head {head}"


def run(args, labels, out: str) -> None:
    rows, panels, learned = [], [], []
    for ck in load_kernels(args, labels):
        curves, weights = ck.curves(args.max_distance), ck.weight_curves(args.max_distance)
        for name, values in ck.learned_values().items():
            learned.extend((ck.label, ck.name, name, head + 1, repr(v)) for head, v in enumerate(values))
            print(f"{ck.label}: {name} = " + ", ".join(f"{v:.4g}" for v in values))
        title = panel_title(ck.label, ck.name, ck.attention_window, ck.description(args.max_distance))
        panels.append((title, curves, [curve_label(*key) for key in ck.curve_keys()]))
        for index, ((layer, head), row) in enumerate(zip(ck.curve_keys(), curves)):
            for d, bias in enumerate(row):
                rows.append((ck.label, ck.name, layer, head, d, repr(float(bias)),
                             "" if weights is None else repr(float(weights[index, d]))))
        print(f"{ck.label}: {ck.name}, {len(curves)} curves, B({args.max_distance}) = "
              + ", ".join(f"{v:.3g}" for v in curves[:, -1]))
    write_csv(os.path.join(out, "kernels.csv"), ["model", "kernel", "layer", "head", "distance", "bias", "weight"], rows)
    if learned:
        write_csv(os.path.join(out, "kernel-parameters.csv"), ["model", "kernel", "parameter", "head", "value"], learned)
    png = os.path.join(out, "kernels.png")
    draw(lambda: figures.kernels(panels, png), png)


COMMAND = Command(add_parser, run)
