"""What several ``kerple-analyze`` subcommands share: their input options, the checks of those
inputs, loading a model for a data-bin or its kernel curves, and drawing a figure."""

import argparse
import os
import sys
from typing import Callable, Dict, List, NamedTuple, Optional

import torch

from kerple_fairseq.analysis import figures
from kerple_fairseq.analysis.kernel_curves import load_kernel
from kerple_fairseq.errors import UsageError
from kerple_fairseq.evaluation.cli import positive_int
from kerple_fairseq.evaluation.loading import length_limit, load_language_model, scale_rotary_for_length

PROG = "kerple-analyze"


class Command(NamedTuple):
    """A subcommand, as its module declares it."""

    #: ``add_parser(subcommands, name)``: adds the subcommand, with its help and options, to ``subcommands``
    add_parser: Callable[[argparse._SubParsersAction, str], None]
    #: ``run(args, labels, out)``: the analysis of the inputs ``args.path`` named ``labels``, written to ``out``
    run: Callable[[argparse.Namespace, List[str], str], None]
    #: whether inputs sharing a label are training runs (seeds) of one model, rather than a mistake
    seed_runs: bool = False
    #: ``check(args)``: raises :class:`UsageError` for option values argparse lets through
    check: Optional[Callable[[argparse.Namespace], None]] = None


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


def checkpoint_inputs() -> argparse.ArgumentParser:
    """The inputs of an analysis of checkpoints."""
    return inputs("checkpoint", "fairseq checkpoints, drawn side by side",
                  "the figures and numbers (created when they are written)")


def data_inputs() -> argparse.ArgumentParser:
    """The options of an analysis that runs the models on segments of a data-bin's split."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("data", help="the fairseq data-bin the models were trained with")
    parser.add_argument("--gen-subset", default="valid", metavar="SPLIT", help="split to analyse (default: valid)")
    parser.add_argument("--length", type=positive_int, required=True, metavar="L", help="segment length L")
    parser.add_argument("--max-tokens", type=positive_int, default=8192,
                        help="input tokens per forward pass (default: 8192)")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even where CUDA is available")
    parser.add_argument("--no-progress-bar", action="store_true", help="no progress bar")
    return parser


def layer_inputs() -> argparse.ArgumentParser:
    """The options of an analysis of kernel curves, for a bias that depends on the layer's input."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--data", metavar="DIR",
                        help="data-bin for a bias that depends on the input (fox): its mean curves are taken "
                        "over the layers' inputs for the split's first tokens")
    parser.add_argument("--gen-subset", default="valid", metavar="SPLIT", help="that split (default: valid)")
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


def check_arguments(args, command: Command) -> List[str]:
    """The labels of ``command``'s inputs, once its options are found fit to run it on."""
    labels = args.labels or default_labels(args.path)
    if len(labels) != len(args.path):
        raise UsageError(f"--labels gives {len(labels)} names for {len(args.path)} checkpoints")
    if command.seed_runs:
        seed_runs(labels)
    elif len(set(labels)) != len(labels):
        raise UsageError("--labels must be distinct")
    if command.check is not None:
        command.check(args)
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise UsageError(f"--out {args.out} exists and is not a directory")
    return labels


def load_kernels(args, labels: List[str]) -> list:
    """The kernel curves of each checkpoint, with the ``--data`` its bias may need."""
    return [load_kernel(p, label, args.data, args.gen_subset) for p, label in zip(args.path, labels)]


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


def draw(figure: Callable[[], None], png: str) -> bool:
    """Draw a figure if matplotlib is there; otherwise say how to get it. Returns whether drawn."""
    try:
        figure()
    except figures.PlotsUnavailable as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return False
    print(f"{PROG}: wrote {png}", file=sys.stderr)
    return True
