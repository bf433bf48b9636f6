"""Cost of the bias kernels against a baseline (no bias, or any other model): training-step and
evaluation time at several lengths, peak memory of one evaluation forward (on CPU in a fresh
process per model, on CUDA in this one), token-by-token generation with and without a trimmed
cache, what compiling FlexAttention cost, and where one step's time goes (``--profile``).
``scripts/benchmark.py`` is its command line; the ``args`` below are that command line's options."""

import argparse
import collections
import json
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from kerple_core.attention import flex
from kerple_core.attention.attend import BACKENDS
from kerple_core.attention.methods import ATTENTION_METHODS
from kerple_core.attention.self_attention import recorded
from kerple_fairseq.experiments.language_models import build_language_model, model_size_flags
from kerple_fairseq.experiments.paths import SCRIPTS

#: stock fairseq models by name: their position encoding (``none``: the causal mask alone)
STOCK = {"none": ["--no-token-positional-embeddings"], "sinusoidal": []}
DEFAULT_MODELS = ["none", "sinusoidal", "alibi", "kerple_log", "kerple_power", "t5"]
#: after "+": a method over the kernel: every attention method (DAPE v1 as dape, v2 as dape-conv, cope,
#: stick-breaking, selective, ssmax, ...), rotary (with ReRoPE or leaky ReRoPE as if at 4x a training length of 512)
ADDED_METHODS = {"": [], **{label: flags for method in ATTENTION_METHODS.values()
                            for label, flags in method.command_lines().items()},
                 "rotary": ["--rotary-embeddings"],
                 **{f"rotary-{r}": ["--rotary-embeddings", "--rotary-scaling", r, "--tokens-per-sample", "512"]
                    for r in ("rerope", "leaky-rerope")}}
#: WikiText-103's vocabulary, the size of ``--wiki103``'s adaptive input and softmax
WIKITEXT_103_VOCAB = 267735


def model_flags(name: str, args: argparse.Namespace, extra: Sequence[str] = ()) -> list:
    """Stock ``transformer_lm`` for ``none`` and ``sinusoidal``, else the plugin with ``--bias-kernel KERNEL``
    for ``name`` = ``KERNEL`` or ``KERNEL+METHOD`` (:data:`ADDED_METHODS`: ``+dape`` is ``--dape mlp``,
    ``+cope`` ``--cope``, ``+stick-breaking`` ``--stick-breaking``, ...), each optionally followed by
    ``@BACKEND`` (``--attention-backend BACKEND``) and by ``/OPTION=VALUE`` model options of its own
    (``alibi+dape/cpu-attention-block-scores=0``: ``--cpu-attention-block-scores 0``, so that one run times
    a model against itself with an option changed), and the ``--model-args`` (then ``extra``). With ``--wiki103``, ALiBi's WikiText-103 architectures
    (``transformer_lm_wiki103``, ``transformer_lm_kerple_wiki103``) at their own size, else ``--layers``,
    ``--width`` and ``--heads``; every model long enough for every length measured."""
    size = [] if args.wiki103 else model_size_flags(args.layers, args.width, args.heads, dropout=0.1)
    positions = ["--max-target-positions", str(max(args.lengths + args.memory_lengths + [1024]))]
    wiki103 = "_wiki103" if args.wiki103 else ""
    name, *options = name.split("/")
    own = []
    for option in options:
        flag, equals, value = option.partition("=")
        if not (flag and equals):
            raise ValueError(f"model option /{option} must be /OPTION=VALUE, e.g. /cpu-attention-block-scores=0")
        own += [f"--{flag}", value]
    name, _, backend = name.partition("@")
    if name in STOCK:
        if backend:
            raise ValueError(f"model {name!r} is stock fairseq: it has no --attention-backend (@{backend})")
        if own:
            raise ValueError(f"model {name!r} is stock fairseq: its options are fairseq's (--model-args), not /{options[0]}")
        return ["--arch", f"transformer_lm{wiki103}", *STOCK[name], *size, *positions]
    kernel, _, method = name.partition("+")
    if method not in ADDED_METHODS:
        raise ValueError(f"unknown model {name!r}: a kernel name, optionally followed by "
                         f"{' or '.join('+' + t for t in ADDED_METHODS if t)}")
    if backend and backend not in BACKENDS:
        raise ValueError(f"unknown attention backend @{backend} in {name}@{backend}: choose one of "
                         f"{', '.join('@' + b for b in BACKENDS)}")
    return ["--arch", f"transformer_lm_kerple{wiki103}", "--bias-kernel", kernel, *ADDED_METHODS[method],
            *(["--attention-backend", backend] if backend else []), *own, *size, *args.model_args, *extra, *positions]


def vocabulary(args: argparse.Namespace) -> int:
    """``--vocab``, else WikiText-103's with ``--wiki103`` and 8000 without."""
    return args.vocab or (WIKITEXT_103_VOCAB if args.wiki103 else 8000)


def build(name: str, args: argparse.Namespace, device: torch.device, extra: Sequence[str] = ()):
    """The model ``name`` (see :func:`model_flags`), initialised from seed 0, on ``device``, in half
    precision with ``--fp16``."""
    torch.manual_seed(0)
    model = build_language_model(model_flags(name, args, extra), vocabulary(args)).to(device)
    return model.half() if args.fp16 else model


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def training_loss(model, tokens):
    """The language-modelling loss of ``tokens``: through the adaptive softmax, as fairseq's
    ``adaptive_loss`` computes it (summed cross-entropy per cluster), where the model has one, else the
    mean cross-entropy over the logits."""
    output, _ = model(tokens)
    adaptive_softmax = model.decoder.adaptive_softmax
    if adaptive_softmax is None:
        return torch.nn.functional.cross_entropy(output.view(-1, output.size(-1)).float(), tokens.view(-1))
    logits, targets = adaptive_softmax(output, tokens.view(-1))
    return sum(torch.nn.functional.cross_entropy(cluster, target, reduction="sum")
               for cluster, target in zip(logits, targets) if target is not None)


def train_step(model, tokens):
    model.train()
    model.zero_grad(set_to_none=True)
    training_loss(model, tokens).backward()


@torch.no_grad()
def eval_forward(model, tokens):
    model.eval()
    model(tokens)


PHASES = {"train": train_step, "eval": eval_forward}


def backend_label(chosen: collections.Counter) -> str:
    """``[flex]``, ``[sdpa]``, ``[flex 16, explicit 2]``; ``[fairseq]`` for stock attention."""
    if not chosen:
        return "[fairseq]"
    if len(chosen) == 1:
        return f"[{next(iter(chosen))}]"
    return "[" + ", ".join(f"{backend} {count}" for backend, count in chosen.most_common()) + "]"


def batch_of(length, args, device):
    """``--batch-tokens`` random tokens as sequences of ``length`` (at least one)."""
    batch = max(1, args.batch_tokens // length)
    return torch.randint(4, vocabulary(args) + 4, (batch, length), device=device)


def time_all(models, args, device):
    """Training steps and evaluation forwards (the ``--phases``) of every model at every length, in
    rotating rounds; ratios to the ``--baseline``. On CUDA, also the peak memory of each model's first
    (untimed) step above what was allocated before it, and its ratio to the baseline's."""
    rows = []
    for length in args.lengths:
        tokens = batch_of(length, args, device)
        batch = tokens.size(0)
        for phase in args.phases:
            step = PHASES[phase]
            times, backends = {name: [] for name in models}, {}
            peaks = {}
            for name, model in models.items():  # warm-up, and on CUDA its peak memory
                if device.type == "cuda":
                    sync(device)
                    torch.cuda.reset_peak_memory_stats(device)
                    before = torch.cuda.memory_allocated(device)
                with recorded(model) as record:
                    step(model, tokens)
                backends[name] = record.backends
                if device.type == "cuda":
                    peaks[name] = torch.cuda.max_memory_allocated(device) - before
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
                ratio = statistics.median(t / base for t, base in zip(times[name], times[args.baseline]))
                peak = peaks.get(name)
                rows.append({"phase": phase, "length": length, "model": name, "batch": batch,
                             "ms": 1000 * seconds, "tokens_per_s": batch * length / seconds, "ratio": ratio,
                             "rounds_ms": [1000 * t for t in times[name]], "backends": dict(backends[name]),
                             "peak_bytes": peak,
                             "peak_ratio": None if peak is None else peak / max(peaks[args.baseline], 1)})
                memory = "" if peak is None else f"  {peak / 2 ** 20:9.1f} MiB x{rows[-1]['peak_ratio']:.3f}"
                print(f"{phase:<5} L={length:<6} {name:<20} {1000 * seconds:9.1f} ms  "
                      f"{batch * length / seconds:9.0f} tok/s  x{ratio:.3f}{memory}  {backend_label(backends[name])}",
                      flush=True)
    return rows


def profile_all(models, args, device):
    """One step of each of the ``--phases`` per model at the longest length, under torch's profiler: the
    ``--profile`` most costly of what ran (CUDA kernels by their time on the GPU; on a CPU, operators by
    their own time), each with its share of the step."""
    length = max(args.lengths)
    tokens = batch_of(length, args, device)
    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_gpu else [])]
    rows = []
    for phase in args.phases:
        for name, model in models.items():
            with profile(activities=activities) as profiled:
                PHASES[phase](model, tokens)
                sync(device)
            events = busy_times(profiled, on_gpu)
            total = sum(us for _, us in events)
            print(f"profile {phase} L={length} {name}: {total / 1000:.1f} ms of {'GPU' if on_gpu else 'CPU'} time",
                  flush=True)
            for event, us in sorted(events, key=lambda pair: -pair[1])[:args.profile]:
                rows.append({"phase": phase, "length": length, "model": name, "name": event.key,
                             "calls": event.count, "ms": us / 1000, "share": us / total if total else 0.0})
                print(f"  {100 * rows[-1]['share']:5.1f}% {us / 1000:9.2f} ms {event.count:5d}x  {event.key[:100]}",
                      flush=True)
    return rows


#: steps of each phase and model the host's view times (the median is kept)
HOST_VIEW_STEPS = 3


def synchronising_sites(run) -> collections.Counter:
    """``run()`` on a GPU with torch's synchronisation debugging on: each operation that made the host wait for the
    device (a value read back, a shape that depends on values, a copy to the host), counted by the Python line
    that asked for it (``file:line``)."""
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run()
    finally:
        torch.cuda.set_sync_debug_mode(before)
    torch.cuda.synchronize()
    return collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught
                               if "synchroniz" in str(w.message).lower())


def host_view(models, args, device):
    """Where the host stands in one step of each of the ``--phases`` per model at the longest length: when the call
    returns (the host's time issuing the step's work, and waiting wherever the step synchronises) and when the
    step ends (its wall time), medians of :data:`HOST_VIEW_STEPS`; on a GPU also the operations that synchronised,
    by the line that asked (:func:`synchronising_sites`). A call that returns long before its step ends was issued
    ahead of the GPU; one that returns with it kept the GPU waiting."""
    length = max(args.lengths)
    tokens = batch_of(length, args, device)
    rows = []
    for phase in args.phases:
        for name, model in models.items():
            returned, ended = [], []
            for _ in range(HOST_VIEW_STEPS):
                sync(device)
                start = time.perf_counter()
                PHASES[phase](model, tokens)
                returned.append(time.perf_counter() - start)
                sync(device)
                ended.append(time.perf_counter() - start)
            sites = synchronising_sites(lambda: PHASES[phase](model, tokens)) if device.type == "cuda" else None
            rows.append({"phase": phase, "length": length, "model": name,
                         "returned_ms": 1000 * statistics.median(returned), "ended_ms": 1000 * statistics.median(ended),
                         "synchronising": None if sites is None else dict(sites.most_common())})
            syncs = "" if sites is None else (f"; synchronised {sum(sites.values())} times: "
                                              + ", ".join(f"{site} x{n}" for site, n in sites.most_common()))
            print(f"host {phase} L={length} {name}: the call returns after {rows[-1]['returned_ms']:.1f} ms, the step "
                  f"ends after {rows[-1]['ended_ms']:.1f} ms{syncs}", flush=True)
    return rows


def busy_times(profiled, on_gpu: bool) -> list:
    """What kept the device busy in a finished profile, as ``(event, microseconds)`` pairs: on a GPU each CUDA
    kernel, copy and fill by its time on the GPU (the host's time launching it not counted; ranges marked by
    ``record_function`` left out), on a CPU each operator by its own time."""
    if on_gpu:
        return [(e, e.self_device_time_total) for e in profiled.key_averages()
                if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    return [(e, e.self_cpu_time_total) for e in profiled.key_averages()]


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
    """One evaluation forward of one sequence on the CPU; prints its peak memory in bytes as JSON."""
    model = build(name, args, device).eval()
    tokens = torch.randint(4, vocabulary(args) + 4, (1, length), device=device)
    before = rss_bytes()
    reset_peak_rss()
    eval_forward(model, tokens)
    peak = rss_bytes("VmHWM") - before
    print(json.dumps({"model": name, "length": length, "peak_bytes": peak}))


def cuda_memory(model, length, args, device):
    """Peak CUDA memory allocated by one evaluation forward of one sequence (after one untimed forward,
    which compiles what it needs), and that forward's tokens per second."""
    tokens = torch.randint(4, vocabulary(args) + 4, (1, length), device=device)
    eval_forward(model, tokens)
    sync(device)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    eval_forward(model, tokens)
    sync(device)
    seconds = time.perf_counter() - start
    return {"peak_bytes": torch.cuda.max_memory_allocated() - before, "tokens_per_s": length / seconds}


def child_memory(name, length, args):
    """Peak memory of one evaluation forward, measured in a fresh child process (:func:`measure_memory`)."""
    cmd = [sys.executable, SCRIPTS / "benchmark.py", "--measure-memory", name, str(length),
           "--layers", str(args.layers), "--width", str(args.width), "--heads", str(args.heads),
           "--vocab", str(vocabulary(args)), "--cpu"] + (["--wiki103"] if args.wiki103 else []) + \
        (["--fp16"] if args.fp16 else []) + (["--model-args", *args.model_args] if args.model_args else [])
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"failed ({out.stderr.strip().splitlines()[-1:]})")
    return {"peak_bytes": json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"]}


def memory_all(args, models, device):
    """Peak memory of one evaluation forward per model and length: on the CPU each in a fresh child
    process (peak RSS), on CUDA with ``models`` in this one (peak allocation, and tokens/s)."""
    rows = []
    for length in args.memory_lengths:
        base = None
        for name in args.models:
            try:
                measured = cuda_memory(models[name], length, args, device) if device.type == "cuda" \
                    else child_memory(name, length, args)
            except RuntimeError as e:  # CUDA's out of memory included
                print(f"memory L={length} {name}: {str(e).splitlines()[0]}", flush=True)
                continue
            peak = measured["peak_bytes"]
            base = peak if name == args.baseline else base
            ratio = peak / base if base else float("nan")
            speed = f"  {measured['tokens_per_s']:9.0f} tok/s" if "tokens_per_s" in measured else ""
            rows.append({"length": length, "model": name, "peak_mib": peak / 2 ** 20, "ratio": ratio,
                         **({"tokens_per_s": measured["tokens_per_s"]} if speed else {})})
            print(f"memory L={length:<6} {name:<20} {peak / 2 ** 20:9.1f} MiB  x{ratio:.3f}{speed}", flush=True)
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
        tokens = torch.randint(4, vocabulary(args) + 4, (1, longest), device=device)
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


def device_name(device: torch.device) -> str:
    """``cuda (NVIDIA H100 80GB HBM3)``, or ``cpu (2 threads)``."""
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return f"cpu ({torch.get_num_threads()} threads)"


def describe(args: argparse.Namespace, device: torch.device) -> str:
    size = "ALiBi's WikiText-103 model (transformer_lm_wiki103)" if args.wiki103 else \
        f"{args.layers} layers, width {args.width}, {args.heads} heads"
    baseline = {"none": "'none' (stock transformer_lm, causal mask only)",
                "sinusoidal": "'sinusoidal' (stock transformer_lm)"}.get(args.baseline, repr(args.baseline))
    return (f"device {device_name(device)}, torch {torch.__version__}; {size}, vocabulary {vocabulary(args)}, "
            f"{'fp16' if args.fp16 else 'fp32'}, {args.batch_tokens} tokens per batch, median of {args.repeats}; "
            f"ratios to {baseline}")


def run(args: argparse.Namespace) -> None:
    """The benchmark with the command line's options ``args`` (or, with ``--measure-memory``, one
    child's memory measurement)."""
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    if args.measure_memory:
        measure_memory(args.measure_memory[0], int(args.measure_memory[1]), args, device)
        return
    if args.baseline not in args.models:
        args.models = [args.baseline, *args.models]
    print(describe(args, device), flush=True)
    started = time.time()
    models = {name: build(name, args, device) for name in args.models}
    results = {"config": {k: v for k, v in vars(args).items() if k != "measure_memory"},
               "device": device_name(device), "timing": time_all(models, args, device)}
    if args.profile:
        results["profile"] = profile_all(models, args, device)
        results["host"] = host_view(models, args, device)
    results["memory"] = memory_all(args, models, device)
    del models
    results["largest_length"] = largest_fitting(results["memory"], args.memory_budget * 2 ** 30)
    for name, length in results["largest_length"].items():
        print(f"memory: {name:<14} fits up to L = {length} in {args.memory_budget:g} GiB "
              "(quadratic fit of the measured peaks; evaluation, one sequence)", flush=True)
    results["generation"] = generation(args, device) if args.generate else []
    compiles, seconds = flex.compile_report()
    results["flex_compiles"] = {"count": compiles, "seconds": seconds}
    print(f"FlexAttention: {compiles} compiles, {seconds:.1f} s in the calls that compiled", flush=True)
    print(f"done in {time.time() - started:.0f} s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
