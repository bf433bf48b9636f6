#!/usr/bin/env python
"""Reproduce KERPLE's Table 10: ALiBi vs KERPLE-log on WikiText-103, trained at 512 (and optionally 2048),
evaluated at 512..3072 under the early-token-cursed and last-token protocols, beside the published numbers.

Trains with ``train_wikitext_103.py`` (ALiBi's recipe, every GPU, fp16) and evaluates with
``kerple-eval-lm``; options it does not know go to fairseq-train (e.g. ``--max-update``).
Finished checkpoints are reused (fairseq resumes an interrupted run from checkpoint_last.pt).
"""

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROG = "reproduce-wikitext-103"
KERNELS = {"alibi": "ALiBi", "kerple_log": "KERPLE-log"}
# KERPLE (Chi et al., 2022) Table 10, validation perplexity, non-overlapping evaluation (SPEC)
PUBLISHED = {
    (512, "alibi"): {512: 19.73, 1024: 18.81, 1536: 18.50, 2048: 18.48, 3072: 18.40},
    (512, "kerple_log"): {512: 19.69, 1024: 18.76, 1536: 18.37, 2048: 18.29, 3072: 18.24},
    (2048, "alibi"): {2048: 17.91, 3072: 17.64},
    (2048, "kerple_log"): {2048: 17.84, 3072: 17.56},
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0],
                                epilog="Any other option goes to fairseq-train.")
    p.add_argument("--data", type=Path, default=REPO / "data-bin" / "wikitext-103",
                   help="the data-bin from prepare-wikitext-103.sh (default: data-bin/wikitext-103)")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "reproduce-wikitext-103",
                   help="checkpoints, evaluations and results.md (default: runs/reproduce-wikitext-103)")
    p.add_argument("--train-lengths", type=int, nargs="+", default=[512], help="512, and 2048 optionally")
    p.add_argument("--eval-lengths", type=int, nargs="+", default=[512, 1024, 1536, 2048, 3072])
    p.add_argument("--num-targets", type=int, default=1000, help="targets of the last-token protocol")
    p.add_argument("--tiny", action="store_true", help="the CPU smoke preset of the training script")
    p.add_argument("--cpu-processes", type=int, default=0, help="passed to the training script")
    return p.parse_known_args(argv)


def run(cmd):
    import subprocess

    print(f"{PROG}: {' '.join(map(str, cmd[1:3]))} ...", file=sys.stderr, flush=True)
    code = subprocess.call([str(c) for c in cmd])
    if code != 0:
        print(f"{PROG}: error: {Path(str(cmd[1])).name} exited with {code}", file=sys.stderr)
        sys.exit(code)


def train(args, extra, kernel, length) -> Path:
    save_dir = args.out / f"{kernel}-{length}"
    cmd = [sys.executable, REPO / "scripts" / "train_wikitext_103.py", kernel, "--data", args.data,
           "--save-dir", save_dir, "--train-length", length, *extra]
    if args.tiny:
        cmd.append("--tiny")
    if args.cpu_processes:
        cmd += ["--cpu-processes", args.cpu_processes]
    run(cmd)
    best = save_dir / "checkpoint_best.pt"
    return best if best.is_file() else save_dir / "checkpoint_last.pt"


def evaluate(args, checkpoint: Path, use_gpu: bool) -> list:
    results = checkpoint.parent / "eval.json"
    cmd = [sys.executable, REPO / "scripts" / "eval_lm.py", args.data, "--path", checkpoint, "--gen-subset", "valid",
           "--protocol", "all", "--lengths", *args.eval_lengths, "--num-targets", args.num_targets,
           "--max-tokens", 16384, "--results-json", results]
    cmd += ["--fp16"] if use_gpu else ["--cpu"]
    run(cmd)
    return json.loads(results.read_text())


def table(results: dict, lengths) -> str:
    """Our rows and, for each (train length, kernel), the published early-token-cursed row."""
    rows = ["| model | trained at | protocol | " + " | ".join(f"L={n}" for n in lengths) + " |",
            "|---|---|---|" + "---|" * len(lengths)]
    for (train_length, kernel), records in results.items():
        for protocol in ("early-token-cursed", "last-token"):
            ppl = {r["length"]: r["ppl"] for r in records if r["protocol"] == protocol}
            cells = [f"{ppl[n]:.2f}" if n in ppl else "" for n in lengths]
            rows.append(f"| {KERNELS[kernel]} (this run) | {train_length} | {protocol} | " + " | ".join(cells) + " |")
        published = PUBLISHED.get((train_length, kernel))
        if published:
            cells = [f"{published[n]:.2f}" if n in published else "" for n in lengths]
            rows.append(f"| {KERNELS[kernel]} (KERPLE Table 10) | {train_length} | early-token-cursed | "
                        + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv=None):
    args, extra = parse_args(argv)
    if not (args.data / "dict.txt").is_file():
        print(f"{PROG}: error: {args.data} is not a data-bin (no dict.txt); run: bash scripts/prepare-wikitext-103.sh "
              f"--dest {args.data}", file=sys.stderr)
        sys.exit(2)
    import torch

    use_gpu = torch.cuda.is_available() and not (args.tiny or args.cpu_processes)
    results = {}
    for length in args.train_lengths:
        for kernel in KERNELS:
            checkpoint = train(args, extra, kernel, length)
            results[length, kernel] = evaluate(args, checkpoint, use_gpu)
    text = ("Validation perplexity on WikiText-103 (early-token-cursed: non-overlapping blocks, every token; "
            f"last-token: the same {args.num_targets} targets after L-1 tokens).\n\n"
            + table(results, args.eval_lengths))
    (args.out / "results.md").write_text(text + "\n")
    print("\n" + text)


if __name__ == "__main__":
    main()
