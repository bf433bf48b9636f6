#!/usr/bin/env python
"""Train a model on WikiText-103 with ALiBi's recipe (KERPLE's Table 10 setting).

Uses every GPU of the machine in fp16, with ``--update-freq`` chosen so that any GPU count
(and any number of nodes) gives the recipe's 8 GPUs x 9216 tokens per update. ``--tiny`` is a
CPU smoke preset of the same pipeline, and ``--cpu-processes N`` runs N gloo processes on CPU
(on each of ``--nodes`` machines). ``--torchrun`` starts the processes through torchrun.
Options this script does not know are passed to fairseq-train unchanged (and override its own).
"""

import argparse
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's kerple_fairseq

from kerple_fairseq.evaluation.cli import positive_int  # noqa: E402
from kerple_fairseq.experiments import recipe  # noqa: E402
from kerple_fairseq.experiments.position_encodings import POSITION_ENCODINGS, position_encoding  # noqa: E402
from kerple_fairseq.experiments.wikitext103 import PrepareError, require_data_bin  # noqa: E402

PROG = "train-wikitext-103"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0],
                                epilog="Any other option goes to fairseq-train, e.g. --max-update 1000.")
    p.add_argument("model", help=f"a comparison's position encoding ({', '.join(POSITION_ENCODINGS)}) or any "
                   "--bias-kernel (on transformer_lm_kerple), on ALiBi's WikiText-103 model (the *_wiki103 "
                   "architectures; with --tiny the small ones)")
    p.add_argument("--data", type=Path, default=REPO / "data-bin" / "wikitext-103",
                   help="the data-bin from prepare-wikitext-103.sh (default: data-bin/wikitext-103)")
    p.add_argument("--save-dir", type=Path, help="checkpoints (default: checkpoints/wikitext-103/MODEL-LENGTH)")
    p.add_argument("--train-length", type=positive_int, default=512, help="--tokens-per-sample (default 512)")
    p.add_argument("--tiny", action="store_true", help="a 2-layer CPU smoke preset of the same pipeline")
    p.add_argument("--cpu-processes", type=int, default=0,
                   help="train on CPU in N processes (gloo; default: all GPUs, or 1 CPU process without GPUs)")
    p.add_argument("--nodes", type=positive_int, default=1, help="number of machines (each runs this script)")
    p.add_argument("--node-rank", type=int, default=0, help="this machine's index, 0..nodes-1")
    p.add_argument("--master", default=None, metavar="HOST:PORT",
                   help="address of node 0 for --nodes > 1 (fairseq's --distributed-init-method tcp://HOST:PORT; "
                   "default on one machine: a free local port)")
    p.add_argument("--torchrun", action="store_true",
                   help="start this machine's processes through torchrun (--nnodes, --node-rank, --master-addr and "
                   "--master-port from the options above) instead of fairseq's spawning or one process per rank")
    p.add_argument("--dry-run", action="store_true",
                   help="print the fairseq-train command line(s) instead of running them (e.g. for torchrun)")
    return p.parse_known_args(argv)


def fail(message):
    print(f"{PROG}: error: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv=None):
    args, extra = parse_args(argv)
    preset = recipe.TINY if args.tiny else recipe.ALIBI_WIKITEXT_103
    try:
        position_encoding(args.model)
        require_data_bin(args.data)
    except (ValueError, PrepareError) as e:
        fail(str(e))
    if args.nodes > 1 and not args.master:
        fail("--nodes > 1 needs --master HOST:PORT (node 0's address, the same on every node)")
    gpus = 0 if (args.tiny or args.cpu_processes) else recipe.gpu_count()
    local_workers = gpus or max(1, args.cpu_processes)
    if not 0 <= args.node_rank < args.nodes:
        fail(f"--node-rank {args.node_rank} is not one of the {args.nodes} machines' 0..{args.nodes - 1}")
    world = local_workers * args.nodes
    freq = recipe.update_freq(preset.reference_workers, world)
    tokens = preset.max_tokens * freq * world
    target = preset.max_tokens * preset.reference_workers
    save_dir = args.save_dir or REPO / "checkpoints" / ("tiny" if args.tiny else "wikitext-103") / \
        f"{args.model}-{args.train_length}"
    note = "" if tokens == target else f" (the recipe's is {target}: {world} workers do not divide it)"
    print(f"{PROG}: {world} {'GPU' if gpus else 'CPU'} worker(s), --update-freq {freq}: "
          f"{tokens} tokens per update{note}; checkpoints in {save_dir}", file=sys.stderr, flush=True)
    if not gpus and not args.tiny:
        print(f"{PROG}: warning: no GPU: the full recipe on CPU takes months; --tiny is the CPU smoke preset",
              file=sys.stderr)
    cmd = recipe.base_command(args.data, args.model, args.train_length, preset, freq, save_dir)
    if args.torchrun:
        commands = [recipe.torchrun_command(cmd, local_workers, args.nodes, args.node_rank, args.master, bool(gpus),
                                            preset.fp16)]
    elif gpus:
        commands = [recipe.gpu_command(cmd, gpus, args.nodes, args.node_rank, args.master, preset.fp16)]
    else:
        commands = recipe.cpu_commands(cmd, local_workers, preset.fp16, args.nodes, args.node_rank, args.master)
    commands = [c + extra for c in commands]  # the user's fairseq-train options last: they win
    if args.dry_run:
        print("\n".join(shlex.join(c) for c in commands))
        sys.exit(0)
    status = recipe.run_all(commands, first_rank=args.node_rank * local_workers, log_dir=save_dir)
    if status != 0:
        last = save_dir / "checkpoint_last.pt"
        resume = f"resumes from {last}" if last.is_file() else f"starts over (no checkpoint in {save_dir} yet)"
        print(f"{PROG}: training stopped before its end; the same command {resume}", file=sys.stderr)
    sys.exit(status)


if __name__ == "__main__":
    main()
