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
from typing import Callable, Dict, List, Optional, Tuple

from kerple_fairseq.evaluation.checkpoint_file import data_only_environment
from kerple_fairseq.experiments.comparison import (
    PROTOCOLS, CommandFailed, Comparison, Model, markdown_table, protocol_rows)
from kerple_fairseq.experiments.language_models import model_size_flags
from kerple_fairseq.experiments.paths import BIN, SCRIPTS, USER_DIR
from kerple_fairseq.experiments.position_encodings import POSITION_ENCODINGS
from kerple_fairseq.experiments.recipe import cpu_training_flags
from kerple_fairseq.experiments.wikitext103 import OFFICIAL_MD5, archive_tokens, preprocess, sample

DEFAULT_MODELS = ["sinusoidal", "alibi", "kerple_log"]  # names in POSITION_ENCODINGS

Run = Tuple[str, int]  # a model's name and the seed it was trained with


WITHOUT_DOWNLOAD = ("with network, run this command again; offline, pass --wikitext-dir DIR or set "
                    "WIKITEXT103_DIR=DIR, where DIR holds wiki.{train,valid,test}.tokens (an unpacked "
                    "wikitext-103-v1.zip)")


def downloaded_sample(url: str, download_dir: Path, md5: str = OFFICIAL_MD5,
                      log: Callable[[str], None] = print) -> Path:
    """The comparison's tokens when none are given: WikiText-103's archive from ``url``, downloaded once
    and md5-checked, unpacked in ``download_dir/wikitext-103``, and the sample cut from it in
    ``download_dir/wikitext-103-sample`` (the first 2.5 MiB of training text, the complete validation
    and test splits: the data of the documented results)."""
    full = archive_tokens(None, url, md5, download_dir, log=log, offline=WITHOUT_DOWNLOAD)
    tokens = sample(full, download_dir / "wikitext-103-sample")
    log(f"WikiText-103 is in {full}; the comparison reads its sample, {tokens}")
    return tokens


def run_name(args: argparse.Namespace, name: str, seed: int) -> str:
    """The directory and table label of a training run: the model's name, with the seed where there are several."""
    return name if len(args.seeds) == 1 else f"{name}-seed{seed}"


def stage(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def training_progress(line: str) -> bool:
    return "train_inner" in line or "| train |" in line or line.startswith(PROTOCOLS)


def run(cmd: list, log: Optional[Path] = None, show: Callable[[str], bool] = training_progress) -> None:
    """Run a command; the lines ``show`` picks go to the terminal, the whole output to ``log`` if given.
    On failure its last 30 lines go to stderr and :class:`CommandFailed` is raised."""
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=data_only_environment())
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


def train(args: argparse.Namespace, data_bin: Path, name: str, seed: int, trained: Dict[tuple, Path]) -> Path:
    """fairseq-train of model ``name`` with ``seed`` from scratch in its run's directory; returns its last
    checkpoint. A model trained as one already in ``trained`` (by flags and seed: ReRoPE's rotary
    model) gets a copy of that checkpoint instead; ``trained`` records each new one."""
    save_dir = args.out / run_name(args, name, seed)
    if save_dir.exists():
        shutil.rmtree(save_dir)
    save_dir.mkdir(parents=True)
    model_flags = POSITION_ENCODINGS[name].model_flags()
    same = trained.get((tuple(model_flags), seed))
    if same is not None:
        stage(f"{name} is trained as {same.parent.name} is: evaluating a copy of its checkpoint")
        shutil.copyfile(same, save_dir / same.name)
        return save_dir / same.name
    stage(f"training {name} ({' '.join(model_flags)}), seed {seed}, {args.updates} updates")
    run([BIN / "fairseq-train", data_bin, "--user-dir", USER_DIR, *model_flags,
         "--kernel-parameterization", args.kernel_parameterization,
         *model_size_flags(args.layers, args.width, args.heads, dropout=0.1),
         *cpu_training_flags(args.train_length, args.max_tokens, lr=0.002, warmup_updates=20, seed=seed,
                             log_format="simple", log_interval=25, adam_betas="(0.9, 0.98)", clip_norm=1.0),
         "--max-update", args.updates, "--save-dir", save_dir,
         "--tensorboard-logdir", args.out / "tensorboard" / save_dir.name],
        log=save_dir / "train.log")
    trained[(tuple(model_flags), seed)] = save_dir / "checkpoint_last.pt"
    return save_dir / "checkpoint_last.pt"


def analyse(args: argparse.Namespace, data_bin: Path, checkpoints: Dict[Run, Path]) -> Path:
    """kerple-analyze's figures and numbers in ``<out>/analysis``: perplexity against length and the
    paired comparison from the evaluation's files of every run (a model's seeds under its name), then
    the five model analyses of each model's first seed."""
    out = args.out / "analysis"
    every_run = ["--labels", *(name for name, _ in checkpoints), "--out", out]
    first = {name: c for (name, seed), c in checkpoints.items() if seed == args.seeds[0]}
    paths = ["--path", *first.values(), "--labels", *first, "--out", out]
    on_data = [data_bin, "--length", max(args.eval_lengths), "--cpu", "--no-progress-bar", "--max-tokens", "16384"]
    analyses = [
        ["extrapolation", "--path", *(c.parent / "eval.json" for c in checkpoints.values()), *every_run],
        ["compare", "--path", *(c.parent / "per-token.npz" for c in checkpoints.values()), *every_run],
        ["kernels", *paths, "--max-distance", max(args.eval_lengths), "--data", data_bin],
        ["effective-length", *paths, "--data", data_bin],
        ["position-wise", *on_data, *paths, "--windowed-reference"],
        ["receptive-field", *on_data, *paths, "--num-segments", args.num_segments],
        ["attention", *on_data, *paths],
    ]
    for analysis in analyses:
        stage(f"kerple-analyze {analysis[0]}")
        run([sys.executable, SCRIPTS / "analyze.py", *analysis],
            show=lambda line: line.startswith((*first, "kerple-analyze", *PROTOCOLS, " ")))
    return out


def table(results: Dict[str, List[dict]], lengths) -> str:
    """A row per run and protocol of its perplexity at each length."""
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
            f"evaluating {run_name(args, *model.key)} at lengths {', '.join(map(str, args.eval_lengths))}: early-token-cursed "
            f"(every token, non-overlapping blocks) and last-token ({args.num_targets} targets)"))
    trained: Dict[tuple, Path] = {}
    evaluated = comparison.train_and_evaluate([
        Model((name, seed), partial(train, args, data_bin, name, seed, trained),
              eval_flags=[*POSITION_ENCODINGS[name].eval_flags,
                          "--position-wise", args.out / run_name(args, name, seed) / "position-wise.csv",
                          "--per-token", args.out / run_name(args, name, seed) / "per-token.npz"])
        for name in args.models for seed in args.seeds])
    results = {run_name(args, *key): e.records for key, e in evaluated.items()}
    text = (f"Validation perplexity (early-token-cursed: every token, non-overlapping blocks; last-token: "
            f"the same {args.num_targets} targets after L-1 tokens), trained at L={args.train_length} "
            f"for {args.updates} updates of {args.max_tokens} tokens; {args.layers} layers, width {args.width}, "
            f"{args.heads} heads, {args.vocab_size or 'full'} vocabulary, seed{'s' * (len(args.seeds) > 1)} "
            f"{', '.join(map(str, args.seeds))}, --kernel-parameterization {args.kernel_parameterization}.\n\n"
            + table(results, args.eval_lengths))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text(text + "\n")
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print("\n" + text + "\n")
    figures = analyse(args, data_bin, {key: e.checkpoint for key, e in evaluated.items()})
    stage(f"figures and their numbers in {figures}: extrapolation, compare (paired-bootstrap intervals), kernels, "
          "effective-length, position-wise, receptive-field, attention (.png with the plots extra, .csv, .json)")
    stage(f"done in {(time.time() - started) / 60:.1f} min; results in {args.out}")
