"""Cost of the bias kernels against no bias: training-step and evaluation time at several lengths,
peak memory of one evaluation forward (in a fresh process per model), and token-by-token
generation with and without a trimmed cache. ``scripts/benchmark.py`` is its command line; the
``args`` below are that command line's options."""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from kerple_fairseq.experiments.language_models import build_language_model, model_size_flags
from kerple_fairseq.experiments.paths import SCRIPTS

STOCK = {"none": ["--arch", "transformer_lm", "--no-token-positional-embeddings"],
         "sinusoidal": ["--arch", "transformer_lm"]}
DEFAULT_MODELS = ["none", "sinusoidal", "alibi", "kerple_log", "kerple_power", "t5"]
#: after "+": DAPE v1 or v2, or CoPE, over the kernel
SCORE_TRANSFORMS = {"": [], "dape": ["--dape", "mlp"], "dape-conv": ["--dape", "conv"], "cope": ["--cope"]}


def model_flags(name: str, args: argparse.Namespace, extra: Sequence[str] = ()) -> list:
    """Stock ``transformer_lm`` for ``none`` and ``sinusoidal``, else the plugin with ``--bias-kernel KERNEL``
    for ``name`` = ``KERNEL`` or ``KERNEL+dape`` / ``+dape-conv`` / ``+cope`` (with ``--dape mlp`` / ``conv``, ``--cope``), and the
    ``--model-args`` (then ``extra``); every model long enough for every length measured."""
    size = model_size_flags(args.layers, args.width, args.heads, dropout=0.1)
    positions = ["--max-target-positions", str(max(args.lengths + args.memory_lengths + [1024]))]
    if name in STOCK:
        return [*STOCK[name], *size, *positions]
    kernel, _, transform = name.partition("+")
    if transform not in SCORE_TRANSFORMS:
        raise ValueError(f"unknown model {name!r}: a kernel name, optionally followed by "
                         f"{' or '.join('+' + t for t in SCORE_TRANSFORMS if t)}")
    return ["--arch", "transformer_lm_kerple", "--bias-kernel", kernel, *SCORE_TRANSFORMS[transform], *size,
            *args.model_args, *extra, *positions]


def build(name: str, args: argparse.Namespace, device: torch.device, extra: Sequence[str] = ()):
    """The model ``name`` (see :func:`model_flags`), initialised from seed 0, on ``device``."""
    torch.manual_seed(0)
    return build_language_model(model_flags(name, args, extra), args.vocab).to(device)


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
    """Training steps and evaluation forwards of every model at every length, in rotating rounds."""
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
    """Peak memory of one evaluation forward per model and length, each in a fresh child process."""
    rows = []
    for length in args.memory_lengths:
        base = None
        for name in args.models:
            cmd = [sys.executable, SCRIPTS / "benchmark.py", "--measure-memory", name, str(length),
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
        model = build("alibi", args, device, ["--max-cache-window", str(cache)] if cache else []).eval()
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


def run(args: argparse.Namespace) -> None:
    """The benchmark with the command line's options ``args`` (or, with ``--measure-memory``, one
    child's memory measurement)."""
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
