"""The fused Triton attention kernel alone against PyTorch's flash attention: the speed step's timing of
attention outside any model (docs/gpu.md).

For each head width, one block of ``--length`` causal queries ``[batch, heads, length, head_dim]``, scaled
beforehand as the fused kernel takes them, is attended by ``scaled_dot_product_attention`` (``scale=1``) under
``sdpa_kernel(FLASH_ATTENTION)`` (on a CPU, whose flash attention takes no dropout, its default backend) and
by :func:`kerple_core.attention.fused.attend` with the bias of each of :data:`BIASES`, both with attention
dropout ``--dropout``. Each is timed forward (autograd
recording, as in training) and forward plus backward (against a fixed random output gradient; the fused
path's gradients include the kernel's parameters, and FoX's gate state, as training takes them): the
median of ``--repeats`` calls after :data:`WARMUP` (CUDA events on a GPU, ``time.perf_counter`` on a CPU), each
call issued on an idle GPU, so that its time includes whatever the GPU waits for while the host prepares and
launches its kernels. On a GPU each is also timed by the GPU's own clock: its CUDA kernels' time in torch's
profiler, the median of :data:`PROFILED` calls, which leaves the host's time out. The JSON, rewritten after
every case, holds the milliseconds (``forward_ms``, ``forward_gpu_ms``, ...) and each bias's ratios to SDPA's
(``forward_ratio``, ``forward_gpu_ratio``, ...).

    python -m gpu_tools.kernel_speed --json kernel-speed.json    # on a GPU: 2048 tokens, heads of 64 and 128
    TRITON_INTERPRET=1 python -m gpu_tools.kernel_speed --json out.json --length 64 --head-dims 16 \\
        --batch 1 --heads 2 --repeats 1                           # on a CPU, under Triton's interpreter
"""

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from kerple_core.attention import fused
from kerple_core.attention.blocks import QueryBlock
from kerple_core.attention.distance_bias import DistanceBias
from kerple_core.attention.layer_bias import LayerBlockBias
from kerple_core.kernels import build_kernel
from kerple_core.layer_biases import LAYER_BIASES, build_layer_bias
from kerple_fairseq.experiments.benchmark import busy_times

#: the biases the fused kernel is timed with: distance kernels, and the Forgetting Transformer's layer bias
BIASES = ("alibi", "kerple_log", "t5", "fox")
#: untimed calls before the timed ones (the first compiles the Triton kernels)
WARMUP = 3
#: profiled calls of each case on a GPU, after its timed ones: the median of their kernels' time is its GPU time
PROFILED = 3


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m gpu_tools.kernel_speed", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--json", type=Path, required=True, help="the timings go here")
    p.add_argument("--length", type=int, default=2048, help="queries and keys (default: %(default)s)")
    p.add_argument("--batch", type=int, default=4, help="default: %(default)s")
    p.add_argument("--heads", type=int, default=16, help="default: %(default)s")
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128], help="default: %(default)s")
    p.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16",
                   help="flash attention's dtypes (default: %(default)s)")
    p.add_argument("--dropout", type=float, default=0.1, help="attention dropout (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=20, help="timed calls of each case (default: %(default)s)")
    args = p.parse_args(argv)
    for name in ("length", "batch", "heads", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not all(1 <= d <= fused.MAX_HEAD_DIM for d in args.head_dims):
        p.error(f"--head-dims must be 1 to {fused.MAX_HEAD_DIM} (the fused kernel's widest head), got {args.head_dims}")
    if not 0 <= args.dropout < 1:
        p.error(f"--dropout must be in [0, 1), got {args.dropout}")
    return args


def block_bias(name: str, heads: int, head_dim: int, batch: int, length: int, device):
    """The bias of one block of ``length`` causal queries, built as the model builds it, and the tensors
    whose gradients training takes from it: the kernel's parameters, or a layer bias's state (FoX's
    cumulative log forget gates, from a random layer input)."""
    block = QueryBlock(0, length, 0, length, 0)
    if name not in LAYER_BIASES:
        kernel = build_kernel(name, heads, head_dim=head_dim).to(device)
        return DistanceBias(kernel).for_block(block, length, shared=False), list(kernel.parameters())
    layer = build_layer_bias(name, heads, heads * head_dim).to(device)
    with torch.no_grad():
        state = layer.key_state(torch.randn(length, batch, heads * head_dim, device=device), None)
    base = DistanceBias(build_kernel(layer.distance_kernel, heads, head_dim=head_dim).to(device))
    return LayerBlockBias(base.for_block(block, length, shared=False), layer, 0, state.requires_grad_()), [state]


def attention_inputs(batch: int, heads: int, length: int, head_dim: int, dtype, device):
    """Seeded queries (scaled beforehand, as the fused kernel takes them), keys, values and an output gradient."""
    torch.manual_seed(0)
    shape = (batch, heads, length, head_dim)
    q = (torch.randn(shape, device=device) * head_dim ** -0.5).to(dtype).requires_grad_()
    k, v = (torch.randn(shape, device=device).to(dtype).requires_grad_() for _ in range(2))
    return q, k, v, torch.randn(shape, device=device).to(dtype)


def sdpa_backend(device):
    """The context SDPA is timed in: flash attention on a GPU, the default backend on a CPU."""
    return sdpa_kernel(SDPBackend.FLASH_ATTENTION) if device.type == "cuda" else contextlib.nullcontext()


def attention_call(name: str, q, k, v, dropout: float):
    """The call timed for ``name`` (``"sdpa"`` or one of :data:`BIASES`) and the tensors its backward differentiates:
    SDPA is called inside :func:`sdpa_backend`, as the caller sets it."""
    if name == "sdpa":
        return (lambda: F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=1.0)), \
            [q, k, v]
    batch, heads, length, head_dim = q.shape
    bias, trained = block_bias(name, heads, head_dim, batch, length, q.device)
    return (lambda: fused.attend(q, k, v, bias, dropout=dropout)), [q, k, v, *trained]


def phases(attend, inputs, grad_out) -> dict:
    """The timed phases of ``attend()``: forward, and forward plus backward to ``inputs``."""
    return {"forward": attend, "forward_backward": lambda: torch.autograd.grad(attend(), inputs, grad_out)}


def milliseconds(run, repeats: int, device) -> float:
    """The median time of ``run()`` over ``repeats`` calls after :data:`WARMUP`."""
    for _ in range(WARMUP):
        run()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            run()
            times.append((time.perf_counter() - begin) * 1000)
    return statistics.median(times)


def gpu_milliseconds(run, device) -> float:
    """The GPU's own time for one ``run()``: the time of its CUDA kernels (copies and fills too) in torch's profiler,
    the host's time preparing and launching them left out; the median of :data:`PROFILED` calls."""
    times = []
    for _ in range(PROFILED):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiled:
            run()
            torch.cuda.synchronize(device)
        times.append(sum(us for _, us in busy_times(profiled, on_gpu=True)) / 1000)
    if not all(times):
        raise SystemExit("kernel_speed: torch's profiler recorded no CUDA kernel of a call, so no time on the GPU's "
                         "clock; check that this torch was built with its CUDA profiler (kineto)")
    return statistics.median(times)


def timed(attend, inputs, grad_out, repeats: int, device) -> dict:
    """``attend()`` timed forward, and forward plus backward to ``inputs``: as called, and on a GPU by its clock."""
    case = {}
    for phase, run in phases(attend, inputs, grad_out).items():
        case[f"{phase}_ms"] = round(milliseconds(run, repeats, device), 4)
        if device.type == "cuda":
            case[f"{phase}_gpu_ms"] = round(gpu_milliseconds(run, device), 4)
    return case


def with_ratios(case: dict, reference: dict) -> dict:
    """``case`` with each of its times over ``reference``'s (``forward_ms`` gives ``forward_ratio``)."""
    return {**case, **{key[:-len("ms")] + "ratio": round(value / reference[key], 4)
                       for key, value in case.items() if key.endswith("_ms")}}


def case_line(head_dim: int, name: str, case: dict) -> str:
    """One case's times, by the GPU's clock in brackets where it was read, with a bias's ratios to SDPA's."""
    def ratio(key):
        return f" ({case[key + '_ratio']:.2f}x)" if key + "_ratio" in case else ""

    def phase(key):
        gpu = f" [GPU {case[key + '_gpu_ms']:.3f} ms{ratio(key + '_gpu')}]" if key + "_gpu_ms" in case else ""
        return f"{case[key + '_ms']:8.3f} ms{ratio(key)}{gpu}"

    return (f"head dim {head_dim:>3}  {name:<10}  forward {phase('forward')}  "
            f"forward+backward {phase('forward_backward')}")


def main(argv=None):
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not fused.runs_on(device):
        sys.exit("kernel_speed: the fused kernel runs on a CUDA GPU with Triton, or on the CPU under Triton's "
                 "interpreter (TRITON_INTERPRET=1 before Triton is imported)")
    flash = device.type == "cuda"
    dtype = getattr(torch, args.dtype)
    report = {"device": torch.cuda.get_device_name(device) if flash else "cpu",
              "sdpa_backend": "FLASH_ATTENTION" if flash else "default (on the CPU)",
              **{key: getattr(args, key) for key in ("length", "batch", "heads", "dtype", "dropout", "repeats")},
              "warmup": WARMUP, "head_dims": {}}

    def save():
        args.json.write_text(json.dumps(report, indent=1) + "\n")

    print(f"kernel_speed on {report['device']}: the fused kernel against SDPA (backend: {report['sdpa_backend']}), "
          f"{args.length} causal tokens, batch {args.batch}, {args.heads} heads, {args.dtype}, dropout {args.dropout}, "
          f"median of {args.repeats} after {WARMUP}", flush=True)
    for head_dim in args.head_dims:
        q, k, v, grad_out = attention_inputs(args.batch, args.heads, args.length, head_dim, dtype, device)
        cases = report["head_dims"][str(head_dim)] = {}
        for name in ("sdpa", *BIASES):
            attend, inputs = attention_call(name, q, k, v, args.dropout)
            with sdpa_backend(device):
                case = timed(attend, inputs, grad_out, args.repeats, device)
            cases[name] = case if name == "sdpa" else with_ratios(case, cases["sdpa"])
            save()
            print(case_line(head_dim, name, cases[name]), flush=True)


if __name__ == "__main__":
    main()
