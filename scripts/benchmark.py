#!/usr/bin/env python
"""Cost of the bias kernels: training-step and evaluation time and memory against no bias.

In one process, builds the same tiny language model with each kernel, with ``none`` (stock
fairseq ``transformer_lm`` without positions: the causal mask alone, as fairseq builds it) and
with ``sinusoidal`` (stock ``transformer_lm``), and times, at each length, training steps
(forward + backward on a batch of ``--batch-tokens``) and evaluation forwards. Rounds visit
every model in turn (starting one model later each round), and a model's ratio to ``none`` is
the median over rounds of its time divided by ``none``'s in the same round, so slow drift on a
shared machine cancels; times are medians over the ``--repeats`` rounds.

Peak memory of one evaluation forward at each ``--memory-lengths`` is measured in a fresh
child process per model (CPU: peak RSS above the RSS before the forward, the peak reset just
before it; CUDA: max allocated above the allocation before it).

    python scripts/benchmark.py            # the full tables (about 15 minutes on 2 CPU cores)
    python scripts/benchmark.py --quick    # a smaller table (under 2 minutes)
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fairseq import options  # noqa: E402
from fairseq.data import Dictionary  # noqa: E402
from fairseq.models.transformer_lm import TransformerLanguageModel, base_lm_architecture  # noqa: E402

import kerple_fairseq  # noqa: E402,F401  (registers the plugin)
from kerple_fairseq.models.transformer_lm_kerple import KernelBiasedLanguageModel  # noqa: E402

STOCK = {"none": ["--arch", "transformer_lm", "--no-token-positional-embeddings"],
         "sinusoidal": ["--arch", "transformer_lm"]}
DEFAULT_MODELS = ["none", "sinusoidal", "alibi", "kerple_log", "kerple_power", "t5"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--models", nargs="+", default=DEFAULT_MODELS,
                   help="none, sinusoidal and any --bias-kernel name (default: %(default)s)")
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048], help="sequence lengths timed")
    p.add_argument("--batch-tokens", type=int, default=4096, help="tokens per batch (batch = tokens / length)")
    p.add_argument("--repeats", type=int, default=7, help="timed rounds per model and length (median reported)")
    p.add_argument("--memory-lengths", type=int, nargs="*", default=[2048, 4096, 8192],
                   help="lengths of the one-sequence evaluation forwards whose peak memory is measured; with "
                   "three or more, a quadratic fit estimates the longest sequence that fits in --memory-budget")
    p.add_argument("--memory-budget", type=float, default=16.0, help="GiB for that estimate (default: 16)")
    p.add_argument("--generate", type=int, nargs="*", default=[1024, 4096, 16384], metavar="N",
                   help="generate max(N) tokens one at a time with ALiBi, with and without --max-cache-window, "
                   "and report tokens/s over the first N of each")
    p.add_argument("--max-cache-window", type=int, default=1024, help="the trimmed cache of --generate")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--model-args", nargs=argparse.REMAINDER, default=[],
                   help="more model options for every plugin model, e.g. --attn-window 128 (last)")
    p.add_argument("--quick", action="store_true",
                   help="CI size: lengths 128 256, 3 rounds, memory at 2048 only, alibi and kerple_log")
    p.add_argument("--cpu", action="store_true", help="stay on the CPU where CUDA is available")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--measure-memory", nargs=2, metavar=("MODEL", "LENGTH"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.models = [m for m in DEFAULT_MODELS if m in ("none", "sinusoidal", "alibi", "kerple_log")]
        args.lengths, args.repeats, args.memory_lengths, args.batch_tokens = [128, 256], 3, [2048], 2048
        args.generate, args.max_cache_window = [256, 512], 128
    return args


class Task:
    def __init__(self, vocab):
        self.source_dictionary = self.target_dictionary = Dictionary()
        for i in range(vocab):
            self.source_dictionary.add_symbol(f"w{i}")


def build(name, args, device):
    size = ["--decoder-layers", str(args.layers), "--decoder-embed-dim", str(args.width),
            "--decoder-ffn-embed-dim", str(2 * args.width), "--decoder-attention-heads", str(args.heads),
            "--dropout", "0.1"]
    if name in STOCK:
        flags, cls = STOCK[name] + size, TransformerLanguageModel
    else:
        flags, cls = ["--arch", "transformer_lm_kerple", "--bias-kernel", name, *size, *args.model_args], \
            KernelBiasedLanguageModel
    parsed = options.parse_args_and_arch(options.get_training_parser(), ["unused", "--task", "language_modeling", *flags])
    parsed.max_target_positions = max(args.lengths + args.memory_lengths + [1024])
    if name in STOCK:
        base_lm_architecture(parsed)
    torch.manual_seed(0)
    return cls.build_model(parsed, Task(args.vocab)).to(device)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def train_step(model, tokens):
    model.train()
    model.zero_grad(set_to_none=True)
    logits, _ = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)).float(), tokens.view(-1))
    loss.backward()


@torch.no_grad()
def eval_forward(model, tokens):
    model.eval()
    model(tokens)


def time_all(models, args, device):
    rows = []
    for length in args.lengths:
        batch = max(1, args.batch_tokens // length)
        tokens = torch.randint(4, args.vocab + 4, (batch, length), device=device)
        for phase, step in (("train", train_step), ("eval", eval_forward)):
            times = {name: [] for name in models}
            for name, model in models.items():  # warm-up
                step(model, tokens)
            names = list(models)
            for round_ in range(args.repeats):
                for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                    model = models[name]
                    sync(device)
                    start = time.perf_counter()
                    step(model, tokens)
                    sync(device)
                    times[name].append(time.perf_counter() - start)
            for name in models:
                seconds = statistics.median(times[name])
                ratio = statistics.median(t / base for t, base in zip(times[name], times["none"]))
                rows.append({"phase": phase, "length": length, "model": name, "batch": batch,
                             "ms": 1000 * seconds, "tokens_per_s": batch * length / seconds, "ratio": ratio,
                             "rounds_ms": [1000 * t for t in times[name]]})
                print(f"{phase:<5} L={length:<6} {name:<14} {1000 * seconds:9.1f} ms  "
                      f"{batch * length / seconds:9.0f} tok/s  x{ratio:.3f}", flush=True)
    return rows


def rss_bytes(field="VmRSS"):
    """The process's resident memory now ("VmRSS") or at its peak ("VmHWM"), from /proc (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak_rss():
    """Start the peak (VmHWM) afresh, so model building and imports do not count."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def measure_memory(name, length, args, device):
    """One evaluation forward of one sequence; prints its peak memory in bytes as JSON."""
    model = build(name, args, device).eval()
    tokens = torch.randint(4, args.vocab + 4, (1, length), device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        eval_forward(model, tokens)
        peak = torch.cuda.max_memory_allocated() - before
    else:
        before = rss_bytes()
        reset_peak_rss()
        eval_forward(model, tokens)
        peak = rss_bytes("VmHWM") - before
    print(json.dumps({"model": name, "length": length, "peak_bytes": peak}))


def memory_all(args):
    rows = []
    for length in args.memory_lengths:
        base = None
        for name in args.models:
            cmd = [sys.executable, __file__, "--measure-memory", name, str(length),
                   "--layers", str(args.layers), "--width", str(args.width), "--heads", str(args.heads),
                   "--vocab", str(args.vocab)] + (["--cpu"] if args.cpu else []) + \
                (["--model-args", *args.model_args] if args.model_args else [])
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                print(f"memory L={length} {name}: failed ({out.stderr.strip().splitlines()[-1:]})", flush=True)
                continue
            peak = json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"]
            base = peak if name == "none" else base
            ratio = peak / base if base else float("nan")
            rows.append({"length": length, "model": name, "peak_mib": peak / 2 ** 20, "ratio": ratio})
            print(f"memory L={length:<6} {name:<14} {peak / 2 ** 20:9.1f} MiB  x{ratio:.3f}", flush=True)
    return rows


def largest_fitting(rows, budget_bytes):
    """Per model, the longest sequence whose fitted peak memory (a + b L + c L^2) stays within budget."""
    estimates = {}
    for name in dict.fromkeys(r["model"] for r in rows):
        points = [(r["length"], r["peak_mib"] * 2 ** 20) for r in rows if r["model"] == name]
        if len(points) < 3:
            continue
        lengths, peaks = zip(*points)
        c, b, a = np.polyfit(lengths, peaks, 2)
        grid = np.arange(1024, 1 << 22, 1024, dtype=np.float64)
        fits = grid[a + b * grid + max(c, 0.0) * grid ** 2 <= budget_bytes]
        estimates[name] = int(fits[-1]) if fits.size else None
    return estimates


def generation(args, device):
    """ALiBi generating one token at a time: tokens/s over the first N tokens, trimmed cache vs full."""
    rows = []
    longest = max(args.generate)
    for cache in (args.max_cache_window, 0):
        saved = args.model_args
        args.model_args = saved + (["--max-cache-window", str(cache)] if cache else [])
        model = build("alibi", args, device).eval()
        args.model_args = saved
        tokens = torch.randint(4, args.vocab + 4, (1, longest), device=device)
        state, marks = {}, {}
        start = time.perf_counter()
        with torch.no_grad():
            for end in range(1, longest + 1):
                model(tokens[:, :end], incremental_state=state)
                if end in args.generate:
                    sync(device)
                    marks[end] = time.perf_counter() - start
        for n, seconds in sorted(marks.items()):
            label = f"cache {cache}" if cache else "full cache"
            rows.append({"cache": cache, "tokens": n, "tokens_per_s": n / seconds})
            print(f"generate {n:<7} tokens, {label:<11} {n / seconds:8.1f} tok/s", flush=True)
    return rows


def main(argv=None):
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    if args.measure_memory:
        measure_memory(args.measure_memory[0], int(args.measure_memory[1]), args, device)
        return
    if "none" not in args.models:
        args.models = ["none", *args.models]
    print(f"device {device} ({torch.get_num_threads()} threads), torch {torch.__version__}; {args.layers} layers, "
          f"width {args.width}, {args.heads} heads, vocabulary {args.vocab}, {args.batch_tokens} tokens per batch, "
          f"median of {args.repeats}; ratios to 'none' (stock transformer_lm, causal mask only)", flush=True)
    started = time.time()
    models = {name: build(name, args, device) for name in args.models}
    results = {"config": {k: v for k, v in vars(args).items() if k != "measure_memory"},
               "device": str(device), "timing": time_all(models, args, device)}
    del models
    results["memory"] = memory_all(args)
    results["largest_length"] = largest_fitting(results["memory"], args.memory_budget * 2 ** 30)
    for name, length in results["largest_length"].items():
        print(f"memory: {name:<14} fits up to L = {length} in {args.memory_budget:g} GiB "
              "(quadratic fit of the measured peaks; evaluation, one sequence)", flush=True)
    results["generation"] = generation(args, device) if args.generate else []
    print(f"done in {time.time() - started:.0f} s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
