"""``kerple-analyze forget-gates``: where the forget gates of a FoX model trained on the retrieval tasks close
on their examples (:mod:`kerple_fairseq.analysis.forget_gates`); writes ``forget-gates.csv`` (each layer and
head's mean log f by kind of symbol) and ``forget-gates.json`` (with the bias each answer's source gets)."""

import os

from kerple_fairseq.analysis.commands.shared import Command, checkpoint_inputs
from kerple_fairseq.analysis.forget_gates import forget_gates_of, read_forget_gates
from kerple_fairseq.analysis.output_files import write_csv, write_json
from kerple_fairseq.evaluation.cli import positive_int
from kerple_fairseq.evaluation.loading import load_language_model
from kerple_fairseq.evaluation.retrieval_accuracy import retrieval_training
from kerple_fairseq.tasks import retrieval


def add_parser(subcommands, name: str) -> None:
    parser = subcommands.add_parser(name, parents=[checkpoint_inputs()],
                                    help="where a FoX model's forget gates close on the retrieval tasks' examples "
                                    "(checkpoints of fairseq-train --task retrieval)")
    parser.add_argument("--length", type=positive_int, metavar="L",
                        help="the examples' length (default: each checkpoint's training length)")
    parser.add_argument("--num-examples", type=positive_int, default=100,
                        help="validation examples of each task (default: 100)")


def run(args, labels, out: str) -> None:
    rows, summary = [], {}
    for path, label in zip(args.path, labels):
        retrieval_training(path, "forget-gates reads the retrieval tasks' examples: give a FoX model trained on them")
        model, task, cfg = load_language_model(path, None)
        length = args.length or cfg.task.tokens_per_sample
        retrieval.check_lengths(task.settings, task.task_names, [length], "--length")
        forget_gates_of(model)
        model.eval()
        summary[label] = {"checkpoint": path, "length": length, "examples": args.num_examples, "tasks": {}}
        for name in task.task_names:
            found = read_forget_gates(model, task.examples("valid", length, [name]), task.dictionary, args.num_examples)
            for kind, means in found.mean_log_forget.items():
                rows.extend((label, name, layer + 1, head + 1, kind, found.count[kind], repr(float(m)))
                            for layer, per_head in enumerate(means) for head, m in enumerate(per_head))
            summary[label]["tasks"][name] = {
                "count": found.count,
                "mean_log_forget": {kind: means.tolist() for kind, means in found.mean_log_forget.items()},
                "source_bias_median": found.source_bias.tolist()}
            for layer, bias in enumerate(found.source_bias):
                lowest = sorted(found.mean_log_forget, key=lambda kind: found.mean_log_forget[kind][layer].mean())[:2]
                print(f"{label} {name} layer {layer + 1}: bias of the answers' sources (median by head) "
                      + " ".join(f"{b:.2f}" for b in bias) + "; lowest mean log f: "
                      + ", ".join(f"{k} {found.mean_log_forget[k][layer].mean():.3f}" for k in lowest))
    write_csv(os.path.join(out, "forget-gates.csv"),
              ["model", "task", "layer", "head", "kind", "count", "mean_log_forget"], rows)
    write_json(os.path.join(out, "forget-gates.json"), summary)


COMMAND = Command(add_parser, run)
