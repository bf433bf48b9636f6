"""``kerple-analyze``: figures and the numbers behind them, from one or more checkpoints.

    kerple-analyze kernels          --path A.pt B.pt [--max-distance 2048]
    kerple-analyze effective-length --path A.pt B.pt [--max-distance 20480] [--threshold -2]
    kerple-analyze position-wise    DATA --path A.pt B.pt --length 2048 [--windowed-reference]
    kerple-analyze receptive-field  DATA --path A.pt B.pt --length 2048 [--num-segments 32] [--mass 0.99]
    kerple-analyze attention        DATA --path A.pt B.pt --length 2048 [--num-segments 4]
    kerple-analyze compare          --path A.npz B.npz [--protocol P] [--lengths L ...] [--samples 1000]
    kerple-analyze extrapolation    --path A.json B.json [--train-length L]

``compare`` and ``extrapolation`` take several training runs (seeds) of a model under one label:
``--path a1 a2 b1 b2 --labels A A B B``.

Each writes ``<out>/<analysis>.csv`` (and ``receptive-field.json``) and, with matplotlib
installed (the ``plots`` extra), ``<out>/<analysis>.png``; ``compare`` reads the files of
``kerple-eval-lm --per-token`` and writes ``<out>/compare.json``, ``extrapolation`` reads those of
``--results-json``: neither runs a model.
"""

import argparse
import json
import os
import sys
from typing import Callable, Dict, List

import numpy as np
import torch

import kerple_fairseq  # noqa: F401  (registers the plugin's models before checkpoints are loaded)
from kerple_fairseq.analysis import figures, significance
from kerple_fairseq.analysis.attention_by_distance import attention_by_distance
from kerple_fairseq.analysis.kernel_curves import effective_lengths, heads_within, load_kernel
from kerple_fairseq.analysis.output_files import write_csv, write_json
from kerple_fairseq.analysis.position_wise import binned_perplexity, position_wise_loss
from kerple_fairseq.analysis.receptive_field import receptive_field, theoretical_receptive_field
from kerple_fairseq.errors import KernelConfigError, UsageError
from kerple_fairseq.evaluation import per_token
from kerple_fairseq.evaluation.cli import positive_int
from kerple_fairseq.evaluation.loading import length_limit, load_language_model, scale_rotary_for_length, token_stream
from kerple_fairseq.evaluation.spans import PROTOCOLS

PROG = "kerple-analyze"


def inputs(kind: str, path_help: str, writes: str, seeds: bool = False) -> argparse.ArgumentParser:
    """The options every analysis takes: its inputs (``--path``, each a ``kind``), their ``--labels``
    (which may repeat a model's name for its runs if ``seeds``), and the ``--out`` directory of what it ``writes``."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--path", nargs="+", required=True, metavar=kind.upper(), help=path_help)
    runs = (f"; {kind}s of several training runs (seeds) of one model share its name, and every model "
            "needs as many") if seeds else ""
    parser.add_argument("--labels", nargs="+", metavar="LABEL",
                        help=f"one name per {kind} (default: each {kind}'s directory name){runs}")
    parser.add_argument("--out", default="analysis", metavar="DIR",
                        help=f"directory for {writes} (default: analysis)")
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    checkpoints = inputs("checkpoint", "fairseq checkpoints, drawn side by side",
                         "the figures and numbers (created when they are written)")
    data = argparse.ArgumentParser(add_help=False)
    data.add_argument("data", help="the fairseq data-bin the models were trained with")
    data.add_argument("--gen-subset", default="valid", metavar="SPLIT", help="split to analyse (default: valid)")
    data.add_argument("--length", type=positive_int, required=True, metavar="L", help="segment length L")
    data.add_argument("--max-tokens", type=positive_int, default=8192,
                      help="input tokens per forward pass (default: 8192)")
    data.add_argument("--cpu", action="store_true", help="run on the CPU even where CUDA is available")
    data.add_argument("--no-progress-bar", action="store_true", help="no progress bar")

    layer_inputs = argparse.ArgumentParser(add_help=False)
    layer_inputs.add_argument("--data", metavar="DIR",
                              help="data-bin for a bias that depends on the input (fox): its mean curves are taken "
                              "over the layers' inputs for the split's first tokens")
    layer_inputs.add_argument("--gen-subset", default="valid", metavar="SPLIT", help="that split (default: valid)")

    sub = parser.add_subparsers(dest="analysis", required=True, metavar="ANALYSIS")
    kernels = sub.add_parser("kernels", parents=[checkpoints, layer_inputs],
                             help="each head's bias B_h(d) (KERPLE §5.4); per layer for fire and fox")
    kernels.add_argument("--max-distance", type=positive_int, default=2048, help="largest d drawn (default: 2048)")
    effective = sub.add_parser("effective-length", parents=[checkpoints, layer_inputs],
                               help="heads whose bias falls below the threshold by distance x (KERPLE A.5)")
    effective.add_argument("--max-distance", type=positive_int, default=20480,
                           help="x runs over 0..max-distance (default: 20480, as in KERPLE Fig. 6)")
    effective.add_argument("--threshold", type=float, default=-2.0,
                           help="effective length = smallest d with B_h(d) < threshold (default: -2)")
    position = sub.add_parser("position-wise", parents=[checkpoints, data],
                              help="mean perplexity by position in blocks of L tokens (KERPLE §5.5)")
    position.add_argument("--windowed-reference", action="store_true",
                          help="also draw each model with attention limited to its training length")
    position.add_argument("--reference-window", type=positive_int, metavar="W",
                          help="the reference's window instead of the training length (implies --windowed-reference)")
    position.add_argument("--bin-width", type=positive_int, metavar="N",
                          help="positions averaged per point of the figure (default: L/64); the CSV has every position")
    receptive = sub.add_parser("receptive-field", parents=[checkpoints, data],
                               help="cumulative normalized gradient and ERF (Sandwich §5.1)")
    receptive.add_argument("--num-segments", type=positive_int, default=32,
                           help="segments averaged, evenly spread over the split (default: 32)")
    receptive.add_argument("--mass", type=float, default=0.99,
                           help="ERF = fewest most recent tokens holding more than this share (default: 0.99)")
    attention = sub.add_parser("attention", parents=[checkpoints, data],
                               help="each layer's mean attention weight on the key d tokens back (stick-breaking, "
                               "selective attention: recency from the content)")
    attention.add_argument("--num-segments", type=positive_int, default=4,
                           help="the split's first segments of L tokens averaged (default: 4)")
    per_token_files = inputs("file", "kerple-eval-lm --per-token files of one split; the first is the baseline",
                             "compare.json", seeds=True)
    compare = sub.add_parser("compare", parents=[per_token_files],
                             help="perplexity differences to the first model, with paired-bootstrap "
                             "confidence intervals, from kerple-eval-lm --per-token files")
    compare.add_argument("--protocol", choices=PROTOCOLS, help="only this protocol (default: all the files share)")
    compare.add_argument("--lengths", type=positive_int, nargs="+", metavar="L",
                         help="only these lengths (default: all the files share)")
    compare.add_argument("--samples", type=positive_int, default=1000, help="bootstrap samples (default: 1000)")
    compare.add_argument("--seed", type=int, default=1, help="seed of the bootstrap draws (default: 1)")
    compare.add_argument("--confidence", type=float, default=0.95, help="interval level (default: 0.95)")
    results_files = inputs("file", "kerple-eval-lm --results-json files, one per model", "extrapolation.csv and .png",
                           seeds=True)
    extrapolation = sub.add_parser("extrapolation", parents=[results_files],
                                   help="perplexity against evaluation length, one line per model "
                                   "and a panel per protocol, from kerple-eval-lm --results-json files")
    extrapolation.add_argument("--train-length", type=positive_int, metavar="L",
                               help="the training length to mark (default: the one each file records)")
    return parser


def default_labels(paths: List[str]) -> List[str]:
    labels = [os.path.basename(os.path.dirname(os.path.abspath(p))) for p in paths]
    return labels if len(set(labels)) == len(labels) else list(paths)


def seed_runs(labels: List[str]) -> Dict[str, List[int]]:
    """The inputs of each model, by label: inputs sharing a label are training runs of one model
    (seeds), in the order given; every model must have as many."""
    runs = {}
    for i, label in enumerate(labels):
        runs.setdefault(label, []).append(i)
    counts = {label: len(r) for label, r in runs.items()}
    if len(set(counts.values())) != 1:
        raise UsageError("a label repeated names the runs (seeds) of one model, and every model needs as many: "
                         + ", ".join(f"{label} has {n}" for label, n in counts.items()))
    return runs


def check_arguments(args) -> List[str]:
    labels = args.labels or default_labels(args.path)
    if len(labels) != len(args.path):
        raise UsageError(f"--labels gives {len(labels)} names for {len(args.path)} checkpoints")
    if args.analysis in SEED_AWARE:
        seed_runs(labels)
    elif len(set(labels)) != len(labels):
        raise UsageError("--labels must be distinct")
    if args.analysis == "compare" and not 0 < args.confidence < 1:
        raise UsageError(f"--confidence must be between 0 and 1, got {args.confidence}")
    if args.analysis == "receptive-field" and not 0 < args.mass < 1:
        raise UsageError(f"--mass must be between 0 and 1, got {args.mass}")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise UsageError(f"--out {args.out} exists and is not a directory")
    return labels


def draw(figure: Callable[[], None], png: str) -> bool:
    """Draw a figure if matplotlib is there; otherwise say how to get it. Returns whether drawn."""
    try:
        figure()
    except figures.PlotsUnavailable as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return False
    print(f"{PROG}: wrote {png}", file=sys.stderr)
    return True


def panel_title(label: str, kernel: str, attention_window: int, description: str = "") -> str:
    """A checkpoint's label, with its kernel where the label does not name it, its window if any, and
    what its curves show where that needs saying."""
    details = ([] if kernel == label else [f"kernel {kernel}"]) + ([f"window {attention_window}"] if attention_window else [])
    details += [description] if description else []
    return f"{label} ({', '.join(details)})" if details else label


def curve_label(layer, head: int) -> str:
    """``head h``, or ``layer l head h`` for a bias of each layer's own."""
    return f"head {head}" if layer == "" else f"layer {layer} head {head}"


def analyse_kernels(args, labels, out: str) -> None:
    loaded = [load_kernel(p, label, args.data, args.gen_subset) for p, label in zip(args.path, labels)]
    rows, panels, learned = [], [], []
    for ck in loaded:
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


def analyse_effective_length(args, labels, out: str) -> None:
    loaded = [load_kernel(p, label, args.data, args.gen_subset) for p, label in zip(args.path, labels)]
    xs = np.arange(args.max_distance + 1)
    rows, series, counts = [], [], []
    for ck in loaded:
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


def load_for_data(args, path: str):
    """(model, task, training length, device) ready for analysis on ``args.data`` at ``args.length``."""
    model, task, cfg = load_language_model(path, args.data)
    limit = length_limit(model)
    if limit is not None and args.length > limit:
        raise UsageError(f"--length {args.length} exceeds the {limit} learned positional embeddings of {path}")
    scale_rotary_for_length(model, args.length, cfg.task.tokens_per_sample)  # as kerple-eval-lm at this length
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    model.to(device).eval()
    return model, task, cfg.task.tokens_per_sample, device


def analyse_position_wise(args, labels, out: str) -> None:
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


def analyse_receptive_field(args, labels, out: str) -> None:
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


def analyse_attention(args, labels, out: str) -> None:
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


def analyse_compare(args, labels, out: str) -> None:
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


def analyse_extrapolation(args, labels, out: str) -> None:
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


ANALYSES = {
    "kernels": analyse_kernels,
    "effective-length": analyse_effective_length,
    "position-wise": analyse_position_wise,
    "receptive-field": analyse_receptive_field,
    "attention": analyse_attention,
    "compare": analyse_compare,
    "extrapolation": analyse_extrapolation,
}
SEED_AWARE = ("compare", "extrapolation")  # analyses where a repeated label names several runs of one model


def cli_main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    try:
        labels = check_arguments(args)
        ANALYSES[args.analysis](args, labels, args.out)
    except (UsageError, KernelConfigError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    cli_main()
