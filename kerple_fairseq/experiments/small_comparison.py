"""The small offline comparison of position encodings on CPU: small models trained alike but for their
position encoding, evaluated under the early-token-cursed and last-token protocols at several lengths,
tabulated, and analysed by kerple-analyze (perplexity against length, paired-bootstrap intervals,
kernel curves, effective lengths, position-wise perplexity, receptive field)."""

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

#: the models a comparison may hold, by name: the flags of their position encoding; everything else is
#: the same for all (``tests/test_comparison_models.py`` checks it). Learned positions are not among
#: them: they cannot be evaluated beyond the training length.
MODELS = {
    "sinusoidal": ["--arch", "transformer_lm_sinusoidal"],
    "rotary": ["--arch", "transformer_lm_rotary"],
    "nope": ["--arch", "transformer_lm_kerple", "--bias-kernel", "none"],
    "t5": ["--arch", "transformer_lm_kerple", "--bias-kernel", "t5"],
    "alibi": ["--arch", "transformer_lm_alibi"],
    "kerple_log": ["--arch", "transformer_lm_kerple"],
}
DEFAULT_MODELS = ["sinusoidal", "alibi", "kerple_log"]


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


def train(args: argparse.Namespace, data_bin: Path, name: str) -> Path:
    """fairseq-train of model ``name`` from scratch in ``<out>/<name>``; returns its last checkpoint."""
    save_dir = args.out / name
    if save_dir.exists():
        shutil.rmtree(save_dir)
    save_dir.mkdir(parents=True)
    stage(f"training {name} ({' '.join(MODELS[name])}), {args.updates} updates")
    run([BIN / "fairseq-train", data_bin, "--user-dir", USER_DIR, *MODELS[name],
         "--kernel-parameterization", args.kernel_parameterization,
         *model_size_flags(args.layers, args.width, args.heads, dropout=0.1),
         *cpu_training_flags(args.train_length, args.max_tokens, lr=0.002, warmup_updates=20, seed=args.seed,
                             log_format="simple", log_interval=25, adam_betas="(0.9, 0.98)", clip_norm=1.0),
         "--max-update", args.updates, "--save-dir", save_dir,
         "--tensorboard-logdir", args.out / "tensorboard" / name],
        log=save_dir / "train.log")
    return save_dir / "checkpoint_last.pt"


def analyse(args: argparse.Namespace, data_bin: Path, checkpoints: Dict[str, Path]) -> Path:
    """kerple-analyze's figures and numbers for every model, in ``<out>/analysis``: perplexity against
    length and the paired comparison from the evaluation's files, then the four model analyses."""
    out = args.out / "analysis"
    labels = ["--labels", *checkpoints, "--out", out]
    paths = ["--path", *checkpoints.values(), *labels]
    on_data = [data_bin, "--length", max(args.eval_lengths), "--cpu", "--no-progress-bar", "--max-tokens", "16384"]
    analyses = [
        ["extrapolation", "--path", *(c.parent / "eval.json" for c in checkpoints.values()), *labels],
        ["compare", "--path", *(c.parent / "per-token.npz" for c in checkpoints.values()), *labels],
        ["kernels", *paths, "--max-distance", max(args.eval_lengths)],
        ["effective-length", *paths],
        ["position-wise", *on_data, *paths, "--windowed-reference"],
        ["receptive-field", *on_data, *paths, "--num-segments", args.num_segments],
    ]
    for analysis in analyses:
        stage(f"kerple-analyze {analysis[0]}")
        run([sys.executable, SCRIPTS / "analyze.py", *analysis],
            show=lambda line: line.startswith((*checkpoints, "kerple-analyze", *PROTOCOLS, " ")))
    return out


def table(results: Dict[str, list], lengths) -> str:
    """A row per model and protocol of its perplexity at each length."""
    rows = [row for name, records in results.items() for row in protocol_rows([name], records)]
    return markdown_table(["model", "protocol"], rows, lengths)


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
        Model(name, partial(train, args, data_bin, name),
              eval_flags=["--position-wise", args.out / name / "position-wise.csv",
                          "--per-token", args.out / name / "per-token.npz"])
        for name in args.models])
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
    stage(f"figures and their numbers in {figures}: extrapolation, compare (paired-bootstrap intervals), kernels, "
          "effective-length, position-wise, receptive-field (.png with the plots extra, .csv, .json)")
    stage(f"done in {(time.time() - started) / 60:.1f} min; results in {args.out}")
