#!/usr/bin/env python
"""The small offline ALiBi vs KERPLE-log run: preprocess, train two tiny models, evaluate, tabulate.

Reads WikiText-103 ``wiki.{train,valid,test}.tokens`` from ``--wikitext-dir`` (or the
``WIKITEXT103_DIR`` variable), preprocesses them into ``data-bin/``, trains
``transformer_lm_alibi`` and ``transformer_lm_kerple`` with identical settings on CPU,
scores the validation split with ``kerple-eval-lm`` under the early-token-cursed and
last-token protocols at several lengths, prints a perplexity table (also written as
markdown and JSON), and ends with ``kerple-analyze``'s figures of both models: kernel
curves, effective lengths, position-wise perplexity and receptive field.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from wikitext103 import SPLITS, PrepareError, preprocess

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PROTOCOL_LINES = ("early-token-cursed", "last-token")  # kerple-eval-lm's per-result lines
KERNEL_ARCHS = {"alibi": "transformer_lm_alibi", "kerple_log": "transformer_lm_kerple"}
NO_DATA = (
    "no WikiText-103 tokens directory given: pass --wikitext-dir DIR or set WIKITEXT103_DIR=DIR, "
    "where DIR holds wiki.train.tokens, wiki.valid.tokens and wiki.test.tokens (the wikitext-103-v1 "
    "release; offline, the sample in ../shared/data/wikitext-103-sample works)"
)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wikitext-dir", default=os.environ.get("WIKITEXT103_DIR"),
                   help="directory with wiki.{train,valid,test}.tokens (default: $WIKITEXT103_DIR)")
    p.add_argument("--data-bin", type=Path, help="preprocessed output (default: data-bin/<name of the tokens dir>)")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "small-comparison",
                   help="checkpoints, logs and results (default: runs/small-comparison)")
    p.add_argument("--vocab-size", type=int, default=8000,
                   help="keep the most frequent words, the rest become <unk> (CPU cost is dominated by "
                   "the output layer; 0 keeps all)")
    p.add_argument("--train-length", type=int, default=128, help="tokens per training sample")
    p.add_argument("--eval-lengths", type=int, nargs="+", default=[128, 256, 512, 1024, 2048],
                   help="non-overlapping evaluation lengths")
    p.add_argument("--num-targets", type=int, default=200, help="targets of the last-token protocol")
    p.add_argument("--num-segments", type=int, default=32,
                   help="segments of the receptive-field analysis (at the largest evaluation length)")
    p.add_argument("--updates", type=int, default=500, help="training updates per model")
    p.add_argument("--max-tokens", type=int, default=2048, help="tokens per update")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args()


def fail(message):
    print(f"small_comparison: error: {message}", file=sys.stderr)
    sys.exit(2)


def stage(message):
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def run(cmd, log=None, show=lambda line: "train_inner" in line or "| train |" in line or line.startswith(PROTOCOL_LINES)):
    """Run a command; the lines ``show`` picks go to the terminal, the whole log to ``log`` if given."""
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if show(line):
            print("    " + line.rstrip().split(" | ", 1)[-1], flush=True)
    proc.wait()
    if log is not None:
        log.write_text("".join(lines))
    if proc.returncode != 0:
        sys.stderr.write("".join(lines[-30:]))
        fail(f"{Path(str(cmd[0])).name} exited with {proc.returncode}")


def train(args, data_bin: Path, kernel: str) -> Path:
    save_dir = args.out / kernel
    if save_dir.exists():
        shutil.rmtree(save_dir)
    save_dir.mkdir(parents=True)
    stage(f"training {KERNEL_ARCHS[kernel]} (--bias-kernel {kernel}), {args.updates} updates")
    run([BIN / "fairseq-train", data_bin, "--user-dir", REPO / "kerple_fairseq", "--task", "language_modeling",
         "--arch", KERNEL_ARCHS[kernel], "--bias-kernel", kernel,
         "--decoder-layers", args.layers, "--decoder-embed-dim", args.width,
         "--decoder-ffn-embed-dim", 2 * args.width, "--decoder-attention-heads", args.heads,
         "--dropout", "0.1", "--tokens-per-sample", args.train_length, "--sample-break-mode", "none",
         "--max-tokens", args.max_tokens, "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)",
         "--lr", "0.002", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "20",
         "--clip-norm", "1.0", "--max-update", args.updates, "--cpu", "--seed", args.seed,
         "--num-workers", "0", "--disable-validation", "--no-epoch-checkpoints",
         "--log-format", "simple", "--log-interval", "25", "--save-dir", save_dir,
         "--tensorboard-logdir", args.out / "tensorboard" / kernel],
        log=save_dir / "train.log")
    return save_dir / "checkpoint_last.pt"


def evaluate(args, data_bin: Path, checkpoint: Path, kernel: str) -> list:
    """kerple-eval-lm: early-token-cursed and last-token protocols at every length."""
    results = args.out / kernel / "eval.json"
    run([sys.executable, REPO / "scripts" / "eval_lm.py", data_bin, "--path", checkpoint, "--gen-subset", "valid",
         "--cpu", "--no-progress-bar", "--protocol", "all", "--lengths", *args.eval_lengths, "--num-targets", args.num_targets,
         "--max-tokens", "16384", "--results-json", results,
         "--position-wise", args.out / kernel / "position-wise.csv"])
    return json.loads(results.read_text())


def analyse(args, data_bin: Path, checkpoints: dict) -> Path:
    """kerple-analyze's four figures for both models, in ``<out>/analysis``."""
    out = args.out / "analysis"
    paths = ["--path", *checkpoints.values(), "--labels", *checkpoints, "--out", out]
    on_data = [data_bin, "--length", max(args.eval_lengths), "--cpu", "--no-progress-bar", "--max-tokens", "16384"]
    analyses = [
        ["kernels", "--max-distance", max(args.eval_lengths)],
        ["effective-length"],
        ["position-wise", *on_data, "--windowed-reference"],
        ["receptive-field", *on_data, "--num-segments", args.num_segments],
    ]
    for analysis in analyses:
        stage(f"kerple-analyze {analysis[0]}")
        run([sys.executable, REPO / "scripts" / "analyze.py", *analysis, *paths],
            show=lambda line: line.startswith((*checkpoints, "kerple-analyze")))
    return out


def table(results: dict, lengths) -> str:
    rows = ["| kernel | protocol | " + " | ".join(f"L={n}" for n in lengths) + " |",
            "|---|---|" + "---|" * len(lengths)]
    for kernel, records in results.items():
        for protocol in ("early-token-cursed", "last-token"):
            ppl = {r["length"]: r["ppl"] for r in records if r["protocol"] == protocol}
            rows.append(f"| {kernel} | {protocol} | " + " | ".join(f"{ppl[n]:.2f}" for n in lengths) + " |")
    return "\n".join(rows)


def main():
    args = parse_args()
    if not args.wikitext_dir:
        fail(NO_DATA)
    tokens_dir = Path(args.wikitext_dir)
    missing = [f"wiki.{s}.tokens" for s in SPLITS if not (tokens_dir / f"wiki.{s}.tokens").is_file()]
    if missing:
        fail(f"{tokens_dir} lacks {', '.join(missing)}; " + NO_DATA.split(": ", 1)[1])
    if any(n <= 0 for n in [args.train_length, args.updates, args.num_targets, args.num_segments, *args.eval_lengths]):
        fail("--train-length, --updates, --num-targets, --num-segments and --eval-lengths must be positive")
    started = time.time()
    data_bin = args.data_bin or REPO / "data-bin" / tokens_dir.resolve().name
    try:
        preprocess(tokens_dir, data_bin, args.vocab_size, log=stage)
    except PrepareError as e:
        fail(str(e))
    results, checkpoints = {}, {}
    for kernel in KERNEL_ARCHS:
        checkpoint = checkpoints[kernel] = train(args, data_bin, kernel)
        stage(f"evaluating {kernel} at lengths {', '.join(map(str, args.eval_lengths))}: early-token-cursed "
              f"(every token, non-overlapping blocks) and last-token ({args.num_targets} targets)")
        results[kernel] = evaluate(args, data_bin, checkpoint, kernel)
    text = (f"Validation perplexity (early-token-cursed: every token, non-overlapping blocks; last-token: "
            f"the same {args.num_targets} targets after L-1 tokens), trained at L={args.train_length} "
            f"for {args.updates} updates of {args.max_tokens} tokens; {args.layers} layers, width {args.width}, "
            f"{args.heads} heads, {args.vocab_size or 'full'} vocabulary.\n\n" + table(results, args.eval_lengths))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text(text + "\n")
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print("\n" + text + "\n")
    figures = analyse(args, data_bin, checkpoints)
    stage(f"figures and their numbers in {figures}: kernels, effective-length, position-wise, receptive-field "
          "(.png with the plots extra, .csv; receptive-field.json)")
    stage(f"done in {(time.time() - started) / 60:.1f} min; results in {args.out}")


if __name__ == "__main__":
    main()
