"""KERPLE's Table 10: ALiBi vs KERPLE-log (and, optionally, the positional baselines) trained on
WikiText-103 with ALiBi's recipe (through ``scripts/train_wikitext_103.py``), once per seed,
evaluated under the early-token-cursed and last-token protocols, beside the published numbers."""

import argparse
import os
import shutil
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Dict, List, Tuple

from kerple_fairseq.evaluation.checkpoint_file import data_only_environment
from kerple_fairseq.experiments.comparison import CommandFailed, Comparison, Model, markdown_table, protocol_rows
from kerple_fairseq.experiments.finished_steps import file_digest
from kerple_fairseq.experiments.paths import SCRIPTS
from kerple_fairseq.experiments.position_encodings import POSITION_ENCODINGS

TABLE_10_MODELS = ["alibi", "kerple_log"]
# KERPLE (Chi et al., 2022) Table 10, validation perplexity, non-overlapping evaluation
PUBLISHED = {
    (512, "alibi"): {512: 19.73, 1024: 18.81, 1536: 18.50, 2048: 18.48, 3072: 18.40},
    (512, "kerple_log"): {512: 19.69, 1024: 18.76, 1536: 18.37, 2048: 18.29, 3072: 18.24},
    (2048, "alibi"): {2048: 17.91, 3072: 17.64},
    (2048, "kerple_log"): {2048: 17.84, 3072: 17.56},
}


def announced_run(prog: str, cmd: list) -> None:
    """Say which script starts (as ``prog``), run it with its output on the terminal; raise
    :class:`CommandFailed` naming the script if it fails."""
    print(f"{prog}: {' '.join(map(str, cmd[1:3]))} ...", file=sys.stderr, flush=True)
    code = subprocess.call([str(c) for c in cmd], env=data_only_environment())
    if code != 0:
        raise CommandFailed(Path(str(cmd[1])).name, code)


def run_dir(args: argparse.Namespace, model: str, length: int, seed: int) -> Path:
    """``<out>/<model>-<length>``, with ``-seed<S>`` for seeds other than the recipe's 1."""
    return args.out / (f"{model}-{length}" + ("" if seed == 1 else f"-seed{seed}"))


def train(args: argparse.Namespace, extra: List[str], run, log, trained: Dict[tuple, Path], model: str, length: int,
          seed: int) -> Tuple[Path, float]:
    """The training script on ``model`` at ``length`` with ``seed`` (resuming or reusing an earlier run);
    its best checkpoint, or its last if it kept no best, and the seconds it took. A model trained as
    one in ``trained`` (the same architecture and flags, length and seed: rotary under each scaling
    applied at evaluation) gets a copy of that one's checkpoint instead; ``trained`` records each."""
    started = time.time()
    save_dir = run_dir(args, model, length, seed)
    alike = (tuple(POSITION_ENCODINGS[model].model_flags(wiki103=True)), length, seed)
    same = trained.get(alike)
    if same is not None:
        copy = save_dir / same.name
        if not copy.is_file() or file_digest(copy) != file_digest(same):
            save_dir.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(same, save_dir / f"{same.name}.partial")
            os.replace(save_dir / f"{same.name}.partial", copy)
        log(f"{model} is trained as {same.parent.name} is: evaluating a copy of its checkpoint")
        return copy, time.time() - started
    cmd = [sys.executable, SCRIPTS / "train_wikitext_103.py", model, "--data", args.data,
           "--save-dir", save_dir, "--train-length", length, *extra, "--seed", seed]
    if args.tiny:
        cmd.append("--tiny")
    if args.cpu_processes:
        cmd += ["--cpu-processes", args.cpu_processes]
    run(cmd)
    best = save_dir / "checkpoint_best.pt"
    trained[alike] = best if best.is_file() else save_dir / "checkpoint_last.pt"
    return trained[alike], time.time() - started


def table(results: Dict[Tuple[int, str, int], list], lengths) -> str:
    """Our rows (one per training run) and, for each (train length, model), the published
    early-token-cursed row after its first run."""
    rows = []
    for (train_length, model, seed), records in results.items():
        label = POSITION_ENCODINGS[model].label
        rows += protocol_rows([f"{label} (this run, seed {seed})", str(train_length)], records)
        published = PUBLISHED.get((train_length, model))
        if published and seed == min(s for t, m, s in results if (t, m) == (train_length, model)):
            rows.append(([f"{label} (KERPLE Table 10)", str(train_length), "early-token-cursed"], published))
    return markdown_table(["model", "trained at", "protocol"], rows, lengths)


def reproduce(args: argparse.Namespace, extra: List[str], prog: str) -> None:
    """Every model at every training length and seed with ``scripts/reproduce_wikitext_103.py``'s
    options ``args`` (``extra`` goes to fairseq-train), evaluated on GPU in fp16 where there is one (and
    not ``--tiny`` or ``--cpu-processes``), with per-token scores for ``kerple-analyze compare``; the
    table in ``args.out/results.md``. Raises :class:`CommandFailed`."""
    import torch

    use_gpu = torch.cuda.is_available() and not (args.tiny or args.cpu_processes)
    run = partial(announced_run, prog)
    def log(line: str) -> None:
        print(f"{prog}: {line}", file=sys.stderr, flush=True)

    comparison = Comparison(args.data, args.eval_lengths, args.num_targets, ["--fp16"] if use_gpu else ["--cpu"], run,
                            log=log)
    trained: Dict[tuple, Path] = {}
    evaluated = comparison.train_and_evaluate([
        Model((length, model, seed), partial(train, args, extra, run, log, trained, model, length, seed),
              eval_flags=[*POSITION_ENCODINGS[model].eval_flags,
                          "--per-token", run_dir(args, model, length, seed) / "per-token.npz"])
        for length in args.train_lengths for model in args.models for seed in args.seeds])
    text = ("Validation perplexity on WikiText-103 (early-token-cursed: non-overlapping blocks, every token; "
            f"last-token: the same {args.num_targets} targets after L-1 tokens).\n\n"
            + table({key: e.records for key, e in evaluated.items()}, args.eval_lengths))
    (args.out / "results.md").write_text(text + "\n")
    print("\n" + text)
    for length in args.train_lengths:
        runs = [(model, e.checkpoint.parent) for (n, model, _), e in evaluated.items() if n == length]
        if len(args.models) > 1:
            print(f"\n{prog}: paired-bootstrap intervals{' and the spread over seeds' * (len(args.seeds) > 1)} "
                  f"of the models trained at {length}:\n  kerple-analyze compare --path "
                  + " ".join(str(d / "per-token.npz") for _, d in runs)
                  + " --labels " + " ".join(m for m, _ in runs) + f" --out {args.out / f'compare-{length}'}")
