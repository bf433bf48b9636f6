"""The small offline ALiBi vs KERPLE-log comparison on CPU: two small models trained alike, evaluated
under the early-token-cursed and last-token protocols at several lengths, tabulated, and analysed
by kerple-analyze (kernel curves, effective lengths, position-wise perplexity, receptive field)."""

import argparse
import json
import shutil
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Callable, Dict, Optional

from kerple_fairseq.experiments.comparison import (
    PROTOCOLS, CommandFailed, Comparison, Model, markdown_table, protocol_rows)
from kerple_fairseq.experiments.language_models import model_size_flags
from kerple_fairseq.experiments.paths import BIN, SCRIPTS, USER_DIR
from kerple_fairseq.experiments.recipe import cpu_training_flags
from kerple_fairseq.experiments.wikitext103 import preprocess

KERNEL_ARCHS = {"alibi": "transformer_lm_alibi", "kerple_log": "transformer_lm_kerple"}


def stage(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def training_progress(line: str) -> bool:
    return "train_inner" in line or "| train |" in line or line.startswith(PROTOCOLS)


def run(cmd: list, log: Optional[Path] = None, show: Callable[[str], bool] = training_progress) -> None:
    """Run a command; the lines ``show`` picks go to the terminal, the whole output to ``log`` if given.
    On failure its last 30 lines go to stderr and :class:`CommandFailed` is raised."""
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
        raise CommandFailed(Path(str(cmd[0])).name, proc.returncode)


def train(args: argparse.Namespace, data_bin: Path, kernel: str) -> Path:
    """fairseq-train of ``kernel``'s model from scratch in ``<out>/<kernel>``; returns its last checkpoint."""
    save_dir = args.out / kernel
    if save_dir.exists():
        shutil.rmtree(save_dir)
    save_dir.mkdir(parents=True)
    stage(f"training {KERNEL_ARCHS[kernel]} (--bias-kernel {kernel}), {args.updates} updates")
    run([BIN / "fairseq-train", data_bin, "--user-dir", USER_DIR,
         "--arch", KERNEL_ARCHS[kernel], "--bias-kernel", kernel,
         "--kernel-parameterization", args.kernel_parameterization,
         *model_size_flags(args.layers, args.width, args.heads, dropout=0.1),
         *cpu_training_flags(args.train_length, args.max_tokens, lr=0.002, warmup_updates=20, seed=args.seed,
                             log_format="simple", log_interval=25, adam_betas="(0.9, 0.98)", clip_norm=1.0),
         "--max-update", args.updates, "--save-dir", save_dir,
         "--tensorboard-logdir", args.out / "tensorboard" / kernel],
        log=save_dir / "train.log")
    return save_dir / "checkpoint_last.pt"


def analyse(args: argparse.Namespace, data_bin: Path, checkpoints: Dict[str, Path]) -> Path:
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
        run([sys.executable, SCRIPTS / "analyze.py", *analysis, *paths],
            show=lambda line: line.startswith((*checkpoints, "kerple-analyze")))
    return out


def table(results: Dict[str, list], lengths) -> str:
    """A row per kernel and protocol of its perplexity at each length."""
    rows = [row for kernel, records in results.items() for row in protocol_rows([kernel], records)]
    return markdown_table(["kernel", "protocol"], rows, lengths)


def compare(args: argparse.Namespace, tokens_dir: Path, data_bin: Path) -> None:
    """The whole comparison with ``scripts/small_comparison.py``'s options ``args``: ``tokens_dir``
    preprocessed into ``data_bin``, then results, table and figures in ``args.out``. Raises
    :class:`~kerple_fairseq.experiments.wikitext103.PrepareError` or :class:`CommandFailed`."""
    started = time.time()
    preprocess(tokens_dir, data_bin, args.vocab_size, log=stage)
    comparison = Comparison(
        data_bin, args.eval_lengths, args.num_targets, ["--cpu", "--no-progress-bar"], run,
        announce=lambda model: stage(
            f"evaluating {model.key} at lengths {', '.join(map(str, args.eval_lengths))}: early-token-cursed "
            f"(every token, non-overlapping blocks) and last-token ({args.num_targets} targets)"))
    evaluated = comparison.train_and_evaluate([
        Model(kernel, partial(train, args, data_bin, kernel),
              eval_flags=["--position-wise", args.out / kernel / "position-wise.csv"])
        for kernel in args.kernels])
    results = {kernel: e.records for kernel, e in evaluated.items()}
    text = (f"Validation perplexity (early-token-cursed: every token, non-overlapping blocks; last-token: "
            f"the same {args.num_targets} targets after L-1 tokens), trained at L={args.train_length} "
            f"for {args.updates} updates of {args.max_tokens} tokens; {args.layers} layers, width {args.width}, "
            f"{args.heads} heads, {args.vocab_size or 'full'} vocabulary, seed {args.seed}, "
            f"--kernel-parameterization {args.kernel_parameterization}.\n\n" + table(results, args.eval_lengths))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text(text + "\n")
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print("\n" + text + "\n")
    figures = analyse(args, data_bin, {kernel: e.checkpoint for kernel, e in evaluated.items()})
    stage(f"figures and their numbers in {figures}: kernels, effective-length, position-wise, receptive-field "
          "(.png with the plots extra, .csv; receptive-field.json)")
    stage(f"done in {(time.time() - started) / 60:.1f} min; results in {args.out}")
