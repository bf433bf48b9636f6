"""Fused distance-bias attention: one Triton kernel, forward and backward, dropout included.

The bias is read inside the kernel from the per-distance values a
:class:`~kerple_core.attention.distance_bias.DistanceBias` computes once per forward (``[heads,
distances]``, float32, padded with zeros; a weight kernel's ``W`` likewise) or, for a bias linear in the distance
(ALiBi's ``-m d``), computed from the heads' slopes; and, for the Forgetting Transformer, from the
per-key state of its cumulative log forget gates (its term ``c_i - c_j``); it is added in float32 to the
float32 scores and never laid out. Tiles wholly in the future or outside an attention window are skipped.
Attention dropout is applied inside the kernel from a counter-based random stream (a seed drawn from
PyTorch's generator and each cell's query, key and head), which the backward regenerates: no mask is stored.
Its rate is rounded to a multiple of 1/256 (:func:`dropout_threshold`), as FlashAttention-2's is. The backward,
one pass over key tiles, returns the gradients of the queries, keys and values, of the per-distance values (each
tile's logit gradients summed along its diagonals, per program and then in a fixed order, so that they repeat
exactly, up to :data:`DETERMINISTIC_CELLS`) and of the gates' state (row and column sums), from which autograd
reaches every kernel's and gate's parameters. The kernels are in :mod:`kerple_core.attention.fused_kernels`
(FlashAttention-2's structure).

It serves CUDA tensors, and CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, which the
tests use), for float32, float16 and bfloat16 inputs with float32 accumulation (float32 products in IEEE
precision, not TF32). Each launch takes the first of its :func:`settings` whose shared memory its GPU holds.
"""

import functools
import importlib.util
import logging
import math
import os
from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from kerple_core.attention.block_bias import BlockBias
from kerple_core.attention.distance_bias import DistanceBlockBias
from kerple_core.attention.layer_bias import LayerBlockBias

#: ``log2(e)``: the kernels exponentiate in base 2 (:mod:`kerple_core.attention.fused_kernels`)
LOG2E = math.log2(math.e)

#: dtypes the kernel takes
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: largest head dimension (one tile of the head's dimensions)
MAX_HEAD_DIM = 128


class Tiles(NamedTuple):
    """A launch's settings: tiles of ``block_m`` queries and ``block_n`` keys, Triton's ``num_warps`` and
    ``num_stages`` (the loads its loops pipeline: each stage holds its tiles in shared memory)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


#: each kernel's launch settings, the preferred first: a launch takes the first whose shared memory its GPU holds
#: (Triton's OutOfResources refuses the others before they run). The backward's key tiles hold two query tiles, which
#: halves its per-tile temporaries; with 128-dimensional heads both kernels run 8 warps (the forward over 128
#: queries), which keeps their registers from spilling. Chosen from their machine code's cost under a throughput model
#: of an H100 SM and their spills (``python -m gpu_tools.kernel_cost``, docs/performance.md).
FALLBACK = {
    "forward_kernel": (Tiles(64, 64, 4, 2), Tiles(64, 64, 4, 1), Tiles(32, 32, 4, 2), Tiles(32, 32, 4, 1)),
    "backward_kernel": (Tiles(32, 64, 4, 2), Tiles(32, 64, 4, 1), Tiles(16, 32, 4, 1)),
}
#: the settings of a kernel, head width (a power of two) and input size (bytes) that differ from :data:`FALLBACK`'s
SETTINGS = {
    ("backward_kernel", 64, 2): (Tiles(32, 64, 4, 3), *FALLBACK["backward_kernel"]),
    ("backward_kernel", 128, 2): (Tiles(32, 64, 8, 3), Tiles(32, 64, 8, 2), Tiles(32, 64, 8, 1), Tiles(16, 32, 4, 1)),
    ("forward_kernel", 128, 2): (Tiles(128, 64, 8, 3), Tiles(128, 64, 8, 2), *FALLBACK["forward_kernel"]),
}
#: the settings that differ on GPUs before Hopper (compute capability 8: ``mma.sync`` tensor cores), where the backward
#: with 128-dimensional heads compiles, with FoX's gates or a weight kernel, to 32 registers a thread and 15 KB of
#: spills in 32 x 64 tiles (sm_80, any warp count or stages) but not in 16 x 32; the forward keeps the settings its
#: cost was read at there
BEFORE_HOPPER = {
    ("backward_kernel", 128, 2): (Tiles(16, 32, 4, 2), Tiles(16, 32, 4, 1)),
    ("forward_kernel", 128, 2): FALLBACK["forward_kernel"],
}
#: the rows (queries or keys) each program of a kernel takes: the forward's a query tile, the backward's a key tile
PROGRAM_ROWS = {"forward_kernel": "block_m", "backward_kernel": "block_n"}
#: the most cells (batch x heads x key tiles x distances) of the per-distance gradients summed per program in a
#: fixed order (deterministic, 64 MiB of float32); beyond it the programs add into a row per head atomically
DETERMINISTIC_CELLS = 2 ** 24
#: per kernel, device, dtype and compile-time constants: the index in its :func:`settings` of the first that fit
_fitting = {}

logger = logging.getLogger(__name__)
#: why the kernel was set aside in this process (it failed to build or launch), if it was
set_aside_because = []


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Triton is installed."""
    return importlib.util.find_spec("triton") is not None


def runs_on(device: torch.device) -> bool:
    """The kernel can run on ``device``: Triton installed, and a CUDA device (or the CPU under the interpreter)."""
    return available() and (device.type == "cuda" or (device.type == "cpu" and interpreted()))


def not_running_on(device: torch.device) -> str:
    """Why ``--attention-backend fused`` cannot run on ``device``, and what to do (one line)."""
    why = "Triton is not installed" if not available() else f"the model is on {device.type.upper()}"
    return (f"--attention-backend fused runs on CUDA GPUs with Triton, and {why}: choose --attention-backend auto, "
            "which takes the fused kernel wherever it runs (for a trained model: --model-overrides "
            "\"{'attention_backend': 'auto'}\")")


def interpreted() -> bool:
    """Triton's interpreter runs the kernels on CPU tensors (``TRITON_INTERPRET=1`` before Triton is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def kernels():
    """The Triton kernels, imported on first use (importing Triton is left to the run that needs it)."""
    from kerple_core.attention import fused_kernels
    return fused_kernels


class FusedInputs(NamedTuple):
    """What the kernel reads of a block's bias: float32 ``bias`` ``[heads, distances]``, ``weight`` likewise
    (None: no weight kernel), ``gates`` ``[batch, heads, keys]`` (None: no gates), the block's ``offset``
    (query ``t`` and key ``s`` are ``offset + t - s`` apart), attention ``window`` (0: none) and, for a bias linear
    in the distance, the heads' ``slopes`` ``[heads]`` (``bias = -slope * d``: the kernel computes it; else None)."""

    bias: Tensor
    weight: Optional[Tensor]
    gates: Optional[Tensor]
    offset: int
    window: int
    slopes: Optional[Tensor]


def distance_part(bias: BlockBias) -> Optional[DistanceBlockBias]:
    """The distance kernel's bias the kernel reads, or None where it does not serve ``bias``: a distance
    kernel's bias under a visibility of distances alone (causality, a window), alone or with a layer's term
    that is a difference of a per-key state (the Forgetting Transformer's)."""
    if isinstance(bias, LayerBlockBias):
        if not bias.has_state_difference:
            return None
        bias = bias.base
    return bias if type(bias) is DistanceBlockBias and not bias.by_position else None


def fused_inputs(bias: BlockBias, device) -> FusedInputs:
    """The kernel's inputs for a block's bias that it serves (:func:`distance_part`)."""
    distances = distance_part(bias)
    values = distances.distance_values("bias", torch.float32, device)
    weight = distances.distance_values("weight", torch.float32, device) if distances.has_weight else None
    gates = bias.state_difference() if isinstance(bias, LayerBlockBias) else None
    slopes = None if distances.has_weight or values.requires_grad else distances.source.linear_slopes(device)
    return FusedInputs(values, weight, gates, distances.block.offset, distances.source.visibility.window, slopes)


def serves(q: Tensor, bias: BlockBias) -> bool:
    """The kernel can attend the block: Triton installed, CUDA tensors (or CPU ones under the interpreter), a
    dtype it takes, heads of at most :data:`MAX_HEAD_DIM` dimensions, a bias it reads (:func:`distance_part`)."""
    if set_aside_because or not runs_on(q.device) or q.dtype not in DTYPES or q.size(-1) > MAX_HEAD_DIM:
        return False
    return distance_part(bias) is not None


def kernel_errors() -> tuple:
    """Triton's errors of building or launching a kernel on this machine."""
    import triton
    from triton.compiler.errors import CompilationError
    return tuple({CompilationError, getattr(triton, "TritonError", CompilationError)})


def set_aside(error: Exception) -> None:
    """Serve no more blocks in this process: the kernel failed to build or launch here (said once)."""
    if not set_aside_because:
        logger.warning(f"the fused attention kernel failed on this machine ({type(error).__name__}: "
                       f"{str(error).splitlines()[0] if str(error) else ''}); the other backends serve instead "
                       "(--attention-backend fused shows the whole error)")
        set_aside_because.append(error)


def attend(q: Tensor, k: Tensor, v: Tensor, bias: BlockBias, *, dropout: float = 0.0,
           key_padding_mask: Optional[Tensor] = None) -> Tensor:
    """``softmax(q k^T * W + B + c_i - c_j)`` (dropped out) times ``v`` for ``q`` ``[B, H, T, D]`` (already
    scaled), ``k``, ``v`` ``[B, H, S, D]``, ``key_padding_mask`` ``[B, S]`` (True: padding)."""
    inputs = fused_inputs(bias, q.device)
    gates = None if inputs.gates is None else inputs.gates.to(torch.float32)
    padding = None if key_padding_mask is None else key_padding_mask.to(torch.int8).contiguous()
    # the stream's seed from PyTorch's CPU generator (seeded by fairseq's --seed): no device is waited for
    seed = int(torch.randint(0, 2 ** 30, (1,)).item()) if dropout > 0 else 0
    return _FusedAttention.apply(q, k, v, inputs.bias, inputs.weight, gates, padding, inputs.offset, inputs.window,
                                 float(dropout), seed, inputs.slopes)


def dropout_threshold(dropout: float) -> int:
    """The kernels keep a cell whose random byte is at least this: ``dropout`` rounded to a multiple of 1/256, as
    FlashAttention-2's kernels round it (0.1 drops 26/256 = 10.16% of the cells)."""
    return min(256, max(0, round(dropout * 256)))


def keep_probability(dropout: float) -> float:
    """The share of cells the kernels keep under ``dropout`` (kept cells are scaled by its inverse)."""
    return (256 - dropout_threshold(dropout)) / 256


def keep_mask(batch_heads: int, num_queries: int, num_keys: int, dropout: float, seed: int, device,
              transposed: bool = False) -> Tensor:
    """``[batch * heads, queries, keys]`` bool: the cells the kernels keep under dropout ``dropout`` with ``seed``
    (the kernels' own stream, drawn as the forward draws it or, ``transposed``, as the backward does; for tests)."""
    out = torch.empty(batch_heads, num_queries, num_keys, dtype=torch.int8, device=device)
    block = 64
    grid = (triton_cdiv(num_queries, block), triton_cdiv(num_keys, block), batch_heads)
    kernels().keep_mask_kernel[grid](out, seed, num_queries, num_keys, dropout_threshold(dropout),
                                     TRANSPOSED=transposed, BLOCK_M=block, BLOCK_N=block)
    return out.bool()


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def settings(name: str, head_dim: int, dtype: torch.dtype, major: int = 9) -> Tuple[Tiles, ...]:
    """Kernel ``name``'s launch settings for heads of ``head_dim`` dimensions (a power of two) in ``dtype`` on a GPU of
    compute capability ``major`` (Triton's interpreter: 9), the preferred first (:data:`BEFORE_HOPPER`,
    :data:`SETTINGS`, else :data:`FALLBACK`); a launch takes the first whose shared memory its GPU holds."""
    key = (name, head_dim, dtype.itemsize)
    if major < 9 and key in BEFORE_HOPPER:
        return BEFORE_HOPPER[key]
    return SETTINGS.get(key, FALLBACK[name])


def capability_major(device) -> int:
    """The compute capability's major of a CUDA ``device`` (the interpreter's CPU: 9, as Hopper's)."""
    return torch.cuda.get_device_capability(device)[0] if device.type == "cuda" else 9


def launch(name: str, programs: int, batch_heads: int, device, args: tuple, constants: dict) -> None:
    """Launch kernel ``name`` over ``programs`` rows (queries or keys) of ``batch_heads`` heads, with the first of its
    :func:`settings`, from the last that fit these ``constants`` on ``device``, whose shared memory the GPU holds."""
    from triton.runtime.errors import OutOfResources
    kernel = getattr(kernels(), name)
    dtype = args[0].dtype
    candidates = settings(name, constants["BLOCK_D"], dtype, capability_major(device))
    key = (name, str(device), dtype, *sorted(constants.items()))
    for index in range(_fitting.get(key, 0), len(candidates)):
        tiles = candidates[index]
        try:
            kernel[(triton_cdiv(programs, getattr(tiles, PROGRAM_ROWS[name])), batch_heads)](
                *args, **constants, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, num_warps=tiles.num_warps,
                num_stages=tiles.num_stages)
        except OutOfResources:
            if index == len(candidates) - 1:
                raise
            continue
        _fitting[key] = index
        return


def _placeholder(device) -> Tensor:
    return torch.zeros(1, dtype=torch.float32, device=device)


def _contiguous_rows(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class _FusedAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, values, weight, gates, padding, offset, window, dropout, seed, slopes=None):
        q, k, v = _contiguous_rows(q), _contiguous_rows(k), _contiguous_rows(v)
        batch, heads, num_queries, head_dim = q.shape
        num_keys = k.size(2)
        placeholder = _placeholder(q.device)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = torch.empty(batch, heads, num_queries, dtype=torch.float32, device=q.device)
        # base-2 tables and gates: the kernels exponentiate with exp2; the forward reads the tables from the last
        # distance to the first (its addresses then rise along a tile's keys), the backward from the first; a linear
        # bias is its slopes (a table of one distance, which the flip leaves as it is)
        linear = slopes is not None
        pad = kernels().TABLE_PAD.value
        tables = (slopes[:, None] * LOG2E).contiguous() if linear else _padded(values.detach() * LOG2E, pad), \
            placeholder if weight is None else _padded(weight.detach() * LOG2E, pad)
        gates_in = placeholder if gates is None else (gates.detach() * LOG2E).contiguous()
        padding_in = placeholder if padding is None else padding
        threshold = dropout_threshold(dropout)
        keep_scale = 1.0 / keep_probability(dropout) if threshold < 256 else 0.0
        num_distances = values.size(1)
        limit = num_distances if window <= 0 else min(window, num_distances)
        flags = dict(LINEAR=linear, HAS_WEIGHT=weight is not None, HAS_GATES=gates is not None,
                     HAS_PADDING=padding is not None, HAS_DROPOUT=threshold > 0, IEEE=q.dtype == torch.float32,
                     UPCAST=interpreted() and q.dtype == torch.bfloat16,
                     BLOCK_D=max(16, _next_power_of_2(head_dim)), D=head_dim)
        stream = (seed, threshold, keep_scale)
        read = [_shifted_copies(table.flip(-1)) for table in tables]
        row_length = read[0].size(-1)
        launch("forward_kernel", num_queries, batch * heads, q.device, (
            q, k, v, out, lse, *read, gates_in, padding_in, *stream,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
            heads, num_queries, num_keys, num_distances, row_length, offset, limit), flags)
        ctx.save_for_backward(q, k, v, out, lse, *tables, gates_in, padding_in)
        ctx.settings = (offset, limit, num_distances, row_length, stream, flags)
        ctx.needs = (ctx.needs_input_grad[3] or ctx.needs_input_grad[4], gates is not None, weight is not None)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, values, weight, gates, padding = ctx.saved_tensors
        offset, limit, num_distances, row_length, stream, flags = ctx.settings
        bias_grad, has_gates, has_weight = ctx.needs
        grad_out = _contiguous_rows(grad_out)
        batch, heads, num_queries, head_dim = q.shape
        num_keys = k.size(2)
        placeholder = _placeholder(q.device)
        delta = (grad_out.float() * out.float()).sum(-1).contiguous()
        grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # added into by every key tile
        grad_k = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        grad_v = torch.empty(v.shape, dtype=v.dtype, device=v.device)

        def gate_sums(length):
            return torch.zeros(batch, heads, length, dtype=torch.float32, device=q.device) if has_gates else placeholder

        grad_query_gates, grad_key_gates = gate_sums(num_queries), gate_sums(num_keys)
        # the per-distance gradients: a row per key tile where that is small (summed below in a fixed order, so the
        # same inputs give the same gradient), else a row per head that the programs add to atomically
        tiles = triton_cdiv(num_keys, min(t.block_n for t in settings("backward_kernel", flags["BLOCK_D"], q.dtype,
                                                                      capability_major(q.device))))
        per_program = batch * heads * tiles * num_distances <= DETERMINISTIC_CELLS
        rows, row_strides = ((batch, heads, tiles), (heads * tiles, tiles, 1)) if per_program else ((heads,), (0, 1, 0))
        grad_values = values.new_zeros(*rows, num_distances) if bias_grad else placeholder
        grad_weight = values.new_zeros(*rows, num_distances) if bias_grad and has_weight else placeholder
        launch("backward_kernel", num_keys, batch * heads, q.device, (
            q, k, v, grad_out, lse, delta, grad_q, grad_k, grad_v, grad_query_gates, grad_key_gates,
            grad_values, grad_weight, *row_strides, _shifted_copies(values), _shifted_copies(weight), gates, padding,
            *stream,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), grad_out.stride(0), grad_out.stride(1), grad_out.stride(2),
            heads, num_queries, num_keys, num_distances, row_length, offset, limit),
            dict(flags, BIAS_GRAD=bias_grad, ROW_PER_PROGRAM=per_program))
        if has_weight:
            grad_q.mul_(1.0 / LOG2E)  # the kernel multiplied the base-2 weights
        grad_gates = None
        if has_gates:
            grad_gates = grad_key_gates
            grad_gates[..., offset:offset + num_queries] += grad_query_gates
        if per_program and bias_grad:
            grad_values = grad_values.sum((0, 2))
            grad_weight = grad_weight.sum((0, 2)) if has_weight else grad_weight
        return (grad_q.to(q.dtype), grad_k, grad_v, grad_values if bias_grad else None,
                grad_weight if bias_grad and has_weight else None, grad_gates,
                None, None, None, None, None, None)


def _padded(table: Tensor, pad: int) -> Tensor:
    """``table`` ``[heads, distances]`` with ``pad`` zeros on either side of each row (the kernels' masked tiles read
    them in place of the cells they mask)."""
    return torch.nn.functional.pad(table, (pad, pad)).contiguous()


def _shifted_copies(table: Tensor) -> Tensor:
    """``[heads, 4, row]``: each row of ``table`` ``[heads, cells]`` from its cell ``k`` on in copy ``k`` (zeros after
    it, ``row`` a multiple of 16), so that the kernels read any run of cells from a 16-byte boundary
    (:func:`fused_kernels.table_rows`). A table of one cell a row (a linear bias's slopes) is left as it is."""
    if table.size(-1) <= 1:
        return table
    row = -(-table.size(-1) // 16) * 16
    padded = torch.nn.functional.pad(table, (0, row + 3 - table.size(-1)))
    return torch.stack([padded[:, k:k + row] for k in range(4)], 1).contiguous()


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
