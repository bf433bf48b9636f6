#!/usr/bin/env python
"""Train a kernel on WikiText-103 with ALiBi's recipe (KERPLE's Table 10 setting).

Uses every GPU of the machine in fp16, with ``--update-freq`` chosen so that any GPU count
(and any number of nodes) gives the recipe's 8 GPUs x 9216 tokens per update. ``--tiny`` is a
CPU smoke preset of the same pipeline, and ``--cpu-processes N`` runs N gloo processes on CPU.
Options this script does not know are passed to fairseq-train unchanged (and override its own).
"""

import argparse
import math
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import List

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PROG = "train-wikitext-103"

# ALiBi's WikiText-103 recipe (SPEC, "The WikiText-103 setting"), less the per-run options
RECIPE = {
    "flags": ["--arch", "transformer_lm_kerple_wiki103", "--criterion", "adaptive_loss",
              "--optimizer", "nag", "--lr", "1.0", "--clip-norm", "0.1",
              "--lr-scheduler", "cosine", "--lr-period-updates", "270000", "--t-mult", "2", "--lr-shrink", "0.75",
              "--min-lr", "0.0001", "--warmup-updates", "16000", "--warmup-init-lr", "1e-07", "--stop-min-lr", "1e-09",
              "--max-update", "286000", "--sample-break-mode", "none", "--seed", "1",
              "--skip-invalid-size-inputs-valid-test", "--required-batch-size-multiple", "1"],
    "max_tokens": 9216,
    "reference_workers": 8,  # the paper's 8 GPUs: 73,728 tokens per update
}
# the same pipeline on CPU in seconds: a 2-layer, 64-wide model
TINY = {
    "flags": ["--arch", "transformer_lm_kerple", "--decoder-layers", "2", "--decoder-embed-dim", "64",
              "--decoder-ffn-embed-dim", "128", "--decoder-attention-heads", "4", "--criterion", "cross_entropy",
              "--optimizer", "adam", "--lr", "0.003", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "5",
              "--max-update", "20", "--sample-break-mode", "none", "--seed", "1", "--num-workers", "0"],
    "max_tokens": 1024,
    "reference_workers": 2,
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0],
                                epilog="Any other option goes to fairseq-train, e.g. --max-update 1000.")
    p.add_argument("kernel", help="--bias-kernel of the model (alibi, kerple_log, ...)")
    p.add_argument("--data", type=Path, default=REPO / "data-bin" / "wikitext-103",
                   help="the data-bin from prepare-wikitext-103.sh (default: data-bin/wikitext-103)")
    p.add_argument("--save-dir", type=Path, help="checkpoints (default: checkpoints/wikitext-103/KERNEL-LENGTH)")
    p.add_argument("--train-length", type=int, default=512, help="--tokens-per-sample (default 512)")
    p.add_argument("--tiny", action="store_true", help="a 2-layer CPU smoke preset of the same pipeline")
    p.add_argument("--cpu-processes", type=int, default=0,
                   help="train on CPU in N processes (gloo; default: all GPUs, or 1 CPU process without GPUs)")
    p.add_argument("--nodes", type=int, default=1, help="number of machines (each runs this script)")
    p.add_argument("--node-rank", type=int, default=0, help="this machine's index, 0..nodes-1")
    p.add_argument("--master", default=None, metavar="HOST:PORT",
                   help="address of node 0 for --nodes > 1 (fairseq's --distributed-init-method tcp://HOST:PORT)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the fairseq-train command line(s) instead of running them (e.g. for torchrun)")
    return p.parse_known_args(argv)


def fail(message):
    print(f"{PROG}: error: {message}", file=sys.stderr)
    sys.exit(2)


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def update_freq(reference_workers: int, world_size: int) -> int:
    """Batches accumulated per update so that ``world_size`` workers see the recipe's tokens per update."""
    return max(1, math.ceil(reference_workers / world_size))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_command(args, preset, freq: int, save_dir: Path) -> List[str]:
    return [str(BIN / "fairseq-train"), str(args.data), "--user-dir", str(REPO / "kerple_fairseq"),
            "--task", "language_modeling", *preset["flags"], "--bias-kernel", args.kernel,
            "--tokens-per-sample", str(args.train_length), "--max-tokens", str(preset["max_tokens"]),
            "--update-freq", str(freq), "--save-dir", str(save_dir),
            "--tensorboard-logdir", str(save_dir / "tensorboard")]


def cpu_commands(cmd: List[str], processes: int) -> List[List[str]]:
    """One command per gloo process. fairseq 0.12 cannot spawn CPU workers itself (it spawns one per
    GPU) and its torchrun inference assumes CUDA, so each rank is started explicitly."""
    if processes == 1:
        return [cmd + ["--cpu"]]
    init = f"tcp://127.0.0.1:{free_port()}"
    return [cmd + ["--cpu", "--distributed-world-size", str(processes), "--distributed-rank", str(rank),
                   "--distributed-init-method", init, "--distributed-no-spawn",
                   "--distributed-backend", "gloo", "--ddp-backend", "legacy_ddp"]
            for rank in range(processes)]


def gpu_command(cmd: List[str], args, gpus: int) -> List[str]:
    # legacy_ddp: the adaptive softmax leaves some parameters without gradient in a step, which
    # fairseq's c10d DDP rejects
    cmd = cmd + ["--fp16", "--ddp-backend", "legacy_ddp", "--distributed-world-size", str(gpus * args.nodes)]
    if args.nodes > 1:
        cmd += ["--distributed-rank", str(args.node_rank * gpus),
                "--distributed-init-method", f"tcp://{args.master}"]
    return cmd


def run_all(commands: List[List[str]]) -> int:
    """Start every command; if one fails, stop the others. Returns the first non-zero status."""
    procs = [subprocess.Popen(c, stdout=None if i == 0 else subprocess.DEVNULL, stderr=None if i == 0 else subprocess.PIPE)
             for i, c in enumerate(commands)]
    status = 0
    for i, p in enumerate(procs):
        code = p.wait()
        if code != 0 and status == 0:
            status = code
            if i > 0 and p.stderr is not None:
                sys.stderr.write(p.stderr.read().decode(errors="replace")[-3000:])
            for other in procs:
                if other.poll() is None:
                    other.terminate()
    return status


def main(argv=None):
    args, extra = parse_args(argv)
    preset = TINY if args.tiny else RECIPE
    if not (args.data / "dict.txt").is_file():
        fail(f"{args.data} is not a data-bin (no dict.txt); run: bash scripts/prepare-wikitext-103.sh "
             f"--dest {args.data}")
    if args.nodes > 1 and not args.master:
        fail("--nodes > 1 needs --master HOST:PORT (node 0's address, the same on every node)")
    gpus = 0 if (args.tiny or args.cpu_processes) else gpu_count()
    local_workers = gpus or max(1, args.cpu_processes)
    if args.nodes > 1 and not gpus:
        fail("multi-node training needs GPUs; on CPU use --cpu-processes N on one machine")
    world = local_workers * args.nodes
    freq = update_freq(preset["reference_workers"], world)
    tokens = preset["max_tokens"] * freq * world
    target = preset["max_tokens"] * preset["reference_workers"]
    save_dir = args.save_dir or REPO / "checkpoints" / ("tiny" if args.tiny else "wikitext-103") / \
        f"{args.kernel}-{args.train_length}"
    note = "" if tokens == target else f" (the recipe's is {target}: {world} workers do not divide it)"
    print(f"{PROG}: {world} {'GPU' if gpus else 'CPU'} worker(s), --update-freq {freq}: "
          f"{tokens} tokens per update{note}; checkpoints in {save_dir}", file=sys.stderr, flush=True)
    if not gpus and not args.tiny:
        print(f"{PROG}: warning: no GPU: the full recipe on CPU takes months; --tiny is the CPU smoke preset",
              file=sys.stderr)
    cmd = base_command(args, preset, freq, save_dir)
    commands = [gpu_command(cmd, args, gpus)] if gpus else cpu_commands(cmd, local_workers)
    commands = [c + extra for c in commands]  # the user's fairseq-train options last: they win
    if args.dry_run:
        print("\n".join(shlex.join(c) for c in commands))
        sys.exit(0)
    sys.exit(run_all(commands))


if __name__ == "__main__":
    main()
