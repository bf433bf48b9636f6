"""``kerple-eval-lm``: perplexity under several protocols at many lengths in one run.

fairseq-eval-lm's options (positional data dir, ``--path``, ``--gen-subset``,
``--max-tokens``, ``--cpu``, ``--fp16``, ``--model-overrides``, ``--context-window``)
plus ``--protocol``, ``--lengths``, ``--num-targets``, ``--results-json``,
``--position-wise``, ``--per-token`` and ``--attn-window``. The plugin is loaded by this command, so ``--user-dir`` is
only needed for other plugins.
"""

import argparse
import ast
import csv
import json
import math
import os
import sys
from typing import Dict, List

import numpy as np
import torch
from fairseq import options, tasks
from fairseq.dataclass.utils import convert_namespace_to_omegaconf

from kerple_core.attention import flex
from kerple_core.attention.rotary import ROTARY_SCALINGS
from kerple_fairseq.errors import UsageError, first_line
from kerple_fairseq.evaluation import retrieval_accuracy
from kerple_fairseq.evaluation import spans as S
from kerple_fairseq.evaluation.loading import (check_checkpoint, check_data_bin, length_limit, load_language_model,
                                               rotary_embedding, scale_rotary_for_length, token_stream)
from kerple_fairseq.evaluation.per_token import TokenScores, stream_fingerprint
from kerple_fairseq.evaluation.per_token import save as save_per_token
from kerple_fairseq.evaluation.scorer import WindowScorer, loss_by_position
from kerple_fairseq.tasks import retrieval

PROG = "kerple-eval-lm"


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = options.get_eval_lm_parser()
    parser.prog = PROG
    group = parser.add_argument_group("length extrapolation (kerple-eval-lm)")
    group.add_argument("--protocol", choices=S.PROTOCOLS + ("all",), default="early-token-cursed",
                       help="early-token-cursed: non-overlapping blocks, every token scored; sliding: "
                       "fairseq's --context-window C; last-token: the same --num-targets targets at "
                       "every length, each after exactly L-1 tokens; all: the first and last, and "
                       "sliding too when --context-window > 0")
    group.add_argument("--lengths", type=positive_int, nargs="+", default=None,
                       help="evaluation lengths L (default: the --tokens-per-sample in effect)")
    group.add_argument("--num-targets", type=positive_int, default=1000,
                       help="targets of the last-token protocol: evenly spaced over the split, "
                       "each with max(lengths)-1 tokens before it")
    group.add_argument("--results-json", metavar="FILE",
                       help="write [{protocol, length, ppl, loss, num_tokens, train_length}] (loss in base 2, "
                       "ppl = 2**loss; train_length: the checkpoint's --tokens-per-sample)")
    group.add_argument("--position-wise", metavar="FILE",
                       help="write a CSV of the mean base-2 loss at each position 0..L-1 of the "
                       "early-token-cursed blocks (length, position, loss, count)")
    group.add_argument("--per-token", metavar="FILE",
                       help="write every scored token's log-probability, with its stream position, span and "
                       "position in the span, for every protocol and length (.npz), for kerple-analyze compare")
    group.add_argument("--attn-window", type=positive_int, default=None, metavar="W",
                       help="evaluate with attention restricted to the W most recent keys, whatever the "
                       "model was trained with (KERPLE's 'windowed@W'; rotary + W: the super-baseline); "
                       "for checkpoints of this version, the same as --model-overrides \"{'attn_window': W}\"")
    group.add_argument("--rotary-scaling", choices=[k for k in ROTARY_SCALINGS if k != "none"], default=None,
                       help="scale a rotary model's rotation at every evaluated length L by s = L / its training "
                       "length (ntk, yarn), or each query's by the length it has reached (dynamic-ntk), "
                       "whatever it was trained with")
    group.add_argument("--example-scores", metavar="FILE",
                       help="with --task retrieval: write each example's answers and right answers for every "
                       "task and length (.npz), for the retrieval board's paired bootstrap")
    return parser


def protocols_to_run(args) -> List[str]:
    if args.protocol != "all":
        return [args.protocol]
    chosen = ["early-token-cursed", "last-token"]
    if args.context_window > 0:
        chosen.insert(1, "sliding")
    return chosen


def without_plugin_user_dir(argv: List[str]) -> List[str]:
    """Drop a ``--user-dir`` naming this plugin, which this command has already imported
    (fairseq would refuse a second copy, e.g. the repository's beside the installed one)."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--user-dir" and i + 1 < len(argv):
            value, width = argv[i + 1], 2
        elif arg.startswith("--user-dir="):
            value, width = arg.split("=", 1)[1], 1
        else:
            value, width = None, 1
        if value is None or os.path.basename(os.path.normpath(value)) != "kerple_fairseq":
            out.extend(argv[i:i + width])
        i += width
    return out


def load_model(cfg, attn_window=None):
    data = getattr(cfg.task, "data", None)  # the retrieval task draws its examples, reading no data-bin
    if data is not None:
        check_data_bin(data)
    check_checkpoint(cfg.common_eval.path)
    try:
        overrides = ast.literal_eval(cfg.common_eval.model_overrides)
        if not isinstance(overrides, dict):
            raise ValueError(f"got {type(overrides).__name__}")
    except (ValueError, SyntaxError) as e:
        raise UsageError(f"--model-overrides must be a Python dict literal: {first_line(e)}") from e
    model, task, saved = load_language_model(cfg.common_eval.path, data, overrides,
                                             tasks.setup_task(cfg.task), attn_window)
    return model, task, saved.task.tokens_per_sample


def summarise(protocol: str, length: int, scores: List[np.ndarray]) -> Dict:
    num_tokens = int(sum(s.size for s in scores))
    if num_tokens == 0:
        raise UsageError(f"{protocol} at length {length} scored no tokens")
    total = float(sum(s.astype(np.float64).sum() for s in scores))
    loss = -total / num_tokens / math.log(2)
    return {"protocol": protocol, "length": length, "ppl": 2.0 ** loss, "loss": loss, "num_tokens": num_tokens}


def position_wise_rows(length: int, scores: List[np.ndarray]):
    losses, counts = loss_by_position(length, scores)
    return [(length, p, losses[p], int(counts[p])) for p in range(length) if counts[p]]


TABLE_HEADER = f"{'protocol':<20} {'length':>7} {'ppl':>10} {'loss':>8} {'tokens':>10}"


def format_row(r: Dict) -> str:
    return f"{r['protocol']:<20} {r['length']:>7} {r['ppl']:>10.3f} {r['loss']:>8.4f} {r['num_tokens']:>10}"


def check_output_directories(*outputs) -> None:
    """Each ``(flag, path)`` given must name a file in a directory that exists."""
    for flag, path in outputs:
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise UsageError(f"{flag} {path}: directory {os.path.dirname(os.path.abspath(path))} does not exist")


def check_arguments(args, cfg) -> None:
    """Fail before any work on what would otherwise fail, or be ignored, after it."""
    if cfg.task.sample_break_mode != "none" or cfg.task.add_bos_token:
        raise UsageError("the protocols score fairseq's unbroken token stream: leave --sample-break-mode "
                        "at none and --add-bos-token off")
    check_output_directories(("--results-json", args.results_json), ("--position-wise", args.position_wise),
                             ("--per-token", args.per_token))
    if args.position_wise and "early-token-cursed" not in protocols_to_run(args):
        raise UsageError("--position-wise reports the early-token-cursed blocks: use it with "
                        "--protocol early-token-cursed or all")


def prepared(model, cfg):
    """The model in evaluation mode, on the GPU unless ``--cpu``, in float16 with ``--fp16``; and its device."""
    if cfg.common.fp16:
        model.half()
    if torch.cuda.is_available() and not cfg.common.cpu:
        model.cuda()
    model.prepare_for_inference_(cfg)
    model.eval()
    return model, next(model.parameters()).device


def set_rotary_scaling(model, scaling, train_length: int) -> None:
    if scaling:
        if rotary_embedding(model) is None:
            raise UsageError(f"--rotary-scaling {scaling} needs a model with rotary embeddings")
        rotary_embedding(model).set_scaling(scaling, train_length)


def evaluate(args, cfg) -> int:
    if cfg.task._name == retrieval.NAME:
        return evaluate_retrieval(args, cfg)
    check_arguments(args, cfg)
    model, task, train_length = load_model(cfg, args.attn_window)
    model, device = prepared(model, cfg)

    stream = token_stream(task, cfg.task.data, cfg.dataset.gen_subset, cfg.dataset.dataset_impl)
    inputs = torch.cat([stream.new_tensor([task.source_dictionary.eos()]), stream[:-1]])
    lengths = args.lengths or [cfg.task.tokens_per_sample]
    protocols = protocols_to_run(args)
    if "sliding" in protocols and args.context_window >= min(lengths):
        raise UsageError(f"--context-window {args.context_window} must be smaller than every length")
    limit = length_limit(model)
    scorer = WindowScorer(model, inputs, stream, cfg.dataset.max_tokens or 36000, device,
                          progress=not cfg.common.no_progress_bar)
    targets = None
    if "last-token" in protocols:
        if min(lengths) < 2:
            raise UsageError("the last-token protocol needs lengths >= 2")
        try:
            targets = S.last_token_targets(len(stream), max(lengths), args.num_targets)
        except ValueError as e:
            raise UsageError(str(e)) from e

    set_rotary_scaling(model, args.rotary_scaling, train_length)
    records, positions, failed, per_token = [], [], [], {}
    print(TABLE_HEADER, flush=True)  # the table is printed a row at a time, as each is computed
    for length in lengths:
        if limit is not None and length > limit:
            print(f"{PROG}: error: length {length} exceeds the {limit} learned positional embeddings of "
                  "the model; it cannot be evaluated there (sinusoidal or bias-kernel models can)",
                  file=sys.stderr)
            failed.append(length)
            continue
        scale_rotary_for_length(model, length, train_length)
        for protocol in protocols:
            if protocol == "early-token-cursed":
                spans = S.early_token_cursed(len(stream), length)
            elif protocol == "sliding":
                spans = S.sliding(len(stream), length, args.context_window)
            else:
                spans = S.last_token(targets, length)
            scores = scorer.score(spans, description=f"{protocol} L={length}")
            records.append({**summarise(protocol, length, scores), "train_length": train_length})
            if args.per_token:
                per_token[(protocol, length)] = TokenScores.from_spans(spans, scores)
            if protocol == "early-token-cursed" and args.position_wise:
                positions.extend(position_wise_rows(length, scores))
            print(format_row(records[-1]), flush=True)

    compiles, seconds = flex.compile_report()
    if compiles:
        print(f"FlexAttention: {compiles} compiles, {seconds:.1f} s", flush=True)
    if args.results_json:
        with open(args.results_json, "w") as f:
            json.dump(records, f, indent=1)
    if args.per_token:
        save_per_token(args.per_token, cfg.dataset.gen_subset, stream_fingerprint(stream), per_token)
    if args.position_wise:
        with open(args.position_wise, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["length", "position", "loss", "count"])
            writer.writerows(positions)
    return 1 if failed else 0


RETRIEVAL_HEADER = (f"{'task':<10} {'length':>7} {'accuracy':>9} {'loss':>8} {'answers':>8} {'whole':>9} "
                    f"{'wholes':>7} {'guess':>7}")


def evaluate_retrieval(args, cfg) -> int:
    """Accuracy and loss of the answers of every task of ``--retrieval-tasks`` at every length."""
    for flag, given in (("--per-token", args.per_token), ("--position-wise", args.position_wise),
                        ("--context-window", args.context_window)):
        if given:
            raise UsageError(f"{flag} is for language modelling on a data-bin; --task retrieval writes "
                             "--example-scores")
    check_output_directories(("--results-json", args.results_json), ("--example-scores", args.example_scores))
    if cfg.dataset.gen_subset == "train":
        raise UsageError("--gen-subset train: the training examples are drawn for the mixture of tasks; evaluate "
                         "valid or test")
    lengths = args.lengths or [cfg.task.tokens_per_sample]
    retrieval.check_lengths(retrieval.settings_of(cfg.task), retrieval.task_names(cfg.task.retrieval_tasks), lengths,
                            "length")
    cfg.task.tokens_per_sample = max(lengths)  # the examples' length is each evaluated length
    retrieval_accuracy.check_checkpoint_task(cfg.common_eval.path, cfg.task)
    model, task, train_length = load_model(cfg, args.attn_window)
    model, device = prepared(model, cfg)
    set_rotary_scaling(model, args.rotary_scaling, train_length)
    limit = length_limit(model)
    too_long = [n for n in lengths if limit is not None and n > limit]
    if too_long:
        raise UsageError(f"length {too_long[0]} exceeds the {limit} learned positional embeddings of the model")
    records, scores = [], {}
    print(RETRIEVAL_HEADER, flush=True)
    for length in lengths:
        scale_rotary_for_length(model, length, train_length)
        for name in task.task_names:
            found = retrieval_accuracy.score(model, task.examples(cfg.dataset.gen_subset, length, [name]), device,
                                             cfg.dataset.max_tokens or 16384)
            scores[name, length] = found.per_example()
            records.append(retrieval_accuracy.summary(name, length, found, train_length))
            r = records[-1]
            whole, guess = r["whole_accuracy"], r["chance"]["whole"]["in_context"]
            print(f"{name:<10} {length:>7} {r['accuracy']:>9.4f} {r['loss']:>8.4f} {r['num_answers']:>8} "
                  f"{'-' if whole is None else format(whole, '.4f'):>9} {r['num_whole']:>7} "
                  f"{'-' if guess is None else format(guess, '.4f'):>7}", flush=True)
    if args.results_json:
        with open(args.results_json, "w") as f:
            json.dump(records, f, indent=1)
    if args.example_scores:
        retrieval_accuracy.save(args.example_scores, task.description(cfg.dataset.gen_subset), scores)
    return 0


def cli_main(argv=None) -> None:
    argv = without_plugin_user_dir(list(sys.argv[1:] if argv is None else argv))
    sys.argv[1:] = argv  # fairseq's get_parser also reads --user-dir from sys.argv
    parser = build_parser()
    args = options.parse_args_and_arch(parser, argv)
    cfg = convert_namespace_to_omegaconf(args)
    try:
        sys.exit(evaluate(args, cfg))
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    cli_main()
