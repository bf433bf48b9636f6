"""The fused distance-bias attention kernels' cost, read from their machine code on a machine without a GPU.

Each kernel is compiled as the backend launches it (:mod:`gpu_tools.cross_compile`: the launches recorded from the
backend's own forward and backward of ``[2, 4, 2048, D]`` tensors, the tiles the first of
:func:`kerple_core.attention.fused.settings` whose shared memory the architecture's largest GPU holds), for each
``--arch`` and ``--head-dims``, beside the FlashAttention-2-style kernels of :mod:`gpu_tools.flash_reference`
without a bias, compiled with the same tiles as the first case's fused kernel of the same direction. Per kernel:
registers and spills (``ptxas -v``), shared memory, the loops of its SASS that hold tensor-core instructions and
their instruction mix (:mod:`gpu_tools.sass`), and their cost under :mod:`gpu_tools.throughput`'s model of one SM.

The **main loop** is the loop of the tiles wholly seen, run without masks: the masked tiles' loops run the same tile
with masks added, so it is the tensor-core loop with the fewest operations in Triton's IR (the fewest SASS
instructions where the IR's loops do not match the SASS's, whose counts spill code can blur). Its clocks a cell,
and the clocks a cell of a causal attention of 2048 tokens (the tiles the diagonal crosses at the masked loops'
mean cost, those wholly seen at the main loop's), are set beside the baseline's of the same direction as ratios.

The cases: ALiBi (a bias linear in the distance, computed from its frozen slopes: no table, no per-distance
gradient), KERPLE-log and T5 (tables with per-distance gradients: one kernel for both, compiled once), FoX (the
Forgetting Transformer's gates over a zero, linear, bias) and a weight kernel (``kerple_bias_wht``: a table of
weights on the scores too, with gradients).

The **floor** of a case is the baseline with the bias's own work added to each of its loops (:func:`own_work`: the
instructions a cell needs at the least, without their addresses or the movement of a diagonal's cells), costed
alike: the report gives it as a ratio to the baseline and the kernel's causal cost as a ratio to it.

    python -m gpu_tools.kernel_cost [--arch 80 90] [--head-dims 64 128] [--dtype float16] [--dropout 0.1]
        [--cases alibi kerple_log fox weight] [--directions forward backward] [--json OUT]

Runs Triton's compiler, not its interpreter: ``TRITON_INTERPRET`` unset.
"""

import argparse
import json
import statistics
import sys
from typing import Dict, List, NamedTuple, Optional

import torch

from gpu_tools import cross_compile, flash_reference, sass, throughput
from kerple_core.attention import fused
from kerple_core.attention.fused import Tiles

#: tokens of the recorded launches and of the causal cost
LENGTH = 2048
#: batch and heads of the recorded launches
BATCH, HEADS = 2, 4
#: the dropout stream's seed in the recorded launches
SEED = 12345
#: the baseline's name in the report
BASELINE = "FA2-style"
#: leading opcodes of a main loop printed
LEADING = 10


class Case(NamedTuple):
    """A bias the fused kernel serves: its label, and whether the backend gets a per-distance gradient, a weight
    table, gates, and whether the bias is linear in the distance (computed from a slope, not read)."""

    label: str
    bias_grad: bool
    weight: bool
    gates: bool
    linear: bool


CASES = {
    "alibi": Case("ALiBi", False, False, False, True),
    "kerple_log": Case("KERPLE-log/T5", True, False, False, False),
    "fox": Case("FoX", False, False, True, True),
    "weight": Case("weight kernel", True, True, False, False),
}


def own_work(case: Case, direction: str) -> Dict[str, int]:
    """The instructions a computed cell of ``case`` needs at the least beyond the FlashAttention-2-style kernel's, by
    opcode: the bias added to the score (the softmax's shift no longer folds into the score's multiply-add; for a
    linear bias its key's term), a 4-byte load of the cell's table value (and of its weight), in the backward
    ``dS W`` for a weight kernel, each cell's gradient added into its distance's sum (``dS * score`` into the weight's),
    and the gates' row and column sums. No address arithmetic and no movement of a diagonal's cells to one thread:
    a lower bound of what the bias costs."""
    work = {"FADD": 1, "LDG.E": (0 if case.linear else 1) + case.weight}
    if direction == "backward":
        work["FMUL"] = int(case.weight)
        work["FADD"] += int(case.bias_grad) + 2 * case.gates
        work["FFMA"] = int(case.bias_grad and case.weight)
    return {opcode: count for opcode, count in work.items() if count}


def floor_cost(compiled, tiles: Tiles, arch: int, work: Dict[str, int]) -> dict:
    """The FlashAttention-2-style kernel ``compiled`` (with ``tiles``) with ``work`` (instructions a cell) added to
    each of its tensor-core loops: its main loop's clocks a cell and the causal clocks a cell (:func:`kernel_cost`'s
    figures), under the same model."""
    instructions = sass.parse(sass.disassemble(compiled.asm["cubin"]))
    found, costs = tensor_loops(instructions, tiles, arch)
    main, _ = main_loop(costs, dot_loop_sizes(compiled.asm["ttgir"]))
    per_warp = tiles.block_m * tiles.block_n // (32 * tiles.num_warps)  # one warp instruction: 32 cells
    added = [sass.Instruction(0, opcode, "", None) for opcode, count in work.items() for _ in range(count * per_warp)]
    clocks = [throughput.loop_cost(loop.body + added, tiles.num_warps, tiles.block_m * tiles.block_n,
                                   throughput.SMS[arch]) for loop in found]
    masked = [cost.clocks for index, cost in enumerate(clocks) if index != main] or [clocks[main].clocks]
    return {"per_cell": clocks[main].per_cell,
            "causal_per_cell": causal_per_cell(clocks[main].clocks, masked, tiles.block_m, tiles.block_n)}


def fused_launches(case: Case, dtype: torch.dtype, head_dim: int, dropout: float) -> List[tuple]:
    """``[(direction, Launch)]`` of one forward and backward of the fused backend for ``case``."""
    q, k, v = (torch.zeros(BATCH, HEADS, LENGTH, head_dim, dtype=dtype, requires_grad=True) for _ in range(3))
    values = torch.zeros(HEADS, LENGTH, requires_grad=case.bias_grad)
    weight = torch.zeros(HEADS, LENGTH, requires_grad=True) if case.weight else None
    gates = torch.zeros(BATCH, HEADS, LENGTH, requires_grad=True) if case.gates else None
    with cross_compile.recorded(fused, fused.kernels()) as launches:
        slopes = torch.full((HEADS,), 0.5) if case.linear else None
        out = fused._FusedAttention.apply(q, k, v, values, weight, gates, None, 0, 0, dropout, SEED, slopes)
        forward = len(launches)
        out.float().sum().backward()
    # UPCAST: the interpreter's flag
    return [("forward" if index < forward else "backward", launch._replace(constants=dict(launch.constants,
                                                                                              UPCAST=False)))
            for index, launch in enumerate(launches)]


def baseline_launches(dtype: torch.dtype, head_dim: int, dropout: float) -> List[tuple]:
    """``[(direction, Launch)]`` of one forward and backward of the FlashAttention-2-style baseline."""
    q, k, v = (torch.zeros(BATCH, HEADS, LENGTH, head_dim, dtype=dtype, requires_grad=True) for _ in range(3))
    with cross_compile.recorded(flash_reference, flash_reference) as launches:
        out = flash_reference.attention(q, k, v, dropout, SEED)
        forward = len(launches)
        out.float().sum().backward()
    return [("forward" if index < forward else "backward", launch) for index, launch in enumerate(launches)]


def tensor_loops(instructions: List[sass.Instruction], tiles: Tiles, arch: int) -> tuple:
    """``(loops, costs)``: the innermost loops of ``instructions`` that hold tensor-core instructions, in address
    order, and their costs for a tile of ``tiles`` on ``sm_ARCH``."""
    found = sass.innermost([loop for loop in sass.loops(instructions)
                            if any(throughput.classify(i.opcode) == "tensor" for i in loop.body)])
    return found, [throughput.loop_cost(loop.body, tiles.num_warps, tiles.block_m * tiles.block_n,
                                        throughput.SMS[arch]) for loop in found]


def dot_loop_sizes(ttgir: str) -> List[int]:
    """The operations of each innermost ``scf.for`` loop that holds a dot in Triton's GPU IR, in order (one region
    opened a line ending in ``{``, closed by a line starting with ``}``)."""
    sizes, open_regions = [], []  # each region: [a loop's?, operations, holds a dot?, holds a loop with a dot?]
    for line in ttgir.splitlines():
        text = line.strip()
        if text.startswith("}"):
            is_loop, operations, dot, inner = open_regions.pop()
            if is_loop and dot and not inner:
                sizes.append(operations)
            if open_regions and dot:
                open_regions[-1][2] = True
                open_regions[-1][3] = open_regions[-1][3] or is_loop
        if text.endswith("{"):
            open_regions.append(["scf.for" in text, 0, False, False])
        elif text and not text.startswith("}"):
            for region in open_regions:
                region[1] += 1
                region[2] = region[2] or "tt.dot " in text or "warp_group_dot " in text
    return sizes


def main_loop(costs: List[throughput.Cost], ir_sizes: List[int]) -> tuple:
    """``(index, basis)``: the main loop among the tensor-core loops of ``costs``, the tiles wholly seen. Masks add
    operations, so it is the loop of fewest operations in Triton's IR (``ir_sizes``, one a loop in the same order),
    before register allocation adds spill code; where the IR's loops do not match the SASS's, the loop of fewest
    SASS instructions."""
    if len(ir_sizes) == len(costs):
        return min(range(len(costs)), key=lambda index: ir_sizes[index]), "ir"
    return min(range(len(costs)), key=lambda index: costs[index].instructions), "sass"


def causal_per_cell(main: float, masked: List[float], block_m: int, block_n: int, length: int = LENGTH) -> float:
    """Clocks a computed cell of a causal attention of ``length`` tokens in tiles of ``block_m`` queries and
    ``block_n`` keys: the tiles wholly seen (every query at or after every key) at ``main``'s clocks, those the
    diagonal crosses at the mean of ``masked`` clocks, those wholly in the future skipped."""
    whole = crossed = 0
    for first_query in range(0, length, block_m):
        for first_key in range(0, length, block_n):
            if first_query >= first_key + block_n - 1:
                whole += 1
            elif first_query + block_m - 1 >= first_key:
                crossed += 1
    return (crossed * statistics.mean(masked) + whole * main) / ((crossed + whole) * block_m * block_n)


def kernel_cost(compiled, tiles: Tiles, arch: int, name: str) -> dict:
    """What the machine code of ``compiled`` (kernel ``name`` with ``tiles``) says: resources, tensor-core loops and
    their costs, the main loop and the causal cost a cell."""
    instructions = sass.parse(sass.disassemble(compiled.asm["cubin"]))
    found, costs = tensor_loops(instructions, tiles, arch)
    if not found:
        raise RuntimeError(f"{name}: no loop of its SASS holds a tensor-core instruction")
    ir_sizes = dot_loop_sizes(compiled.asm["ttgir"])
    main, basis = main_loop(costs, ir_sizes)
    masked = [cost.clocks for index, cost in enumerate(costs) if index != main] or [costs[main].clocks]
    return {
        "kernel": name, "tiles": tiles._asdict(), "shared": compiled.metadata.shared,
        **sass.resources(compiled.asm["ptx"], compiled.asm["cubin"], arch)._asdict(),
        "loops": [{"start": loop.start, "end": loop.end, **cost._asdict(), "opcodes": sass.opcode_counts(loop.body),
                   "unknown": throughput.unknown_opcodes(loop.body)} for loop, cost in zip(found, costs)],
        "ir_loop_operations": ir_sizes, "main": main, "main_chosen_by": basis, "per_cell": costs[main].per_cell,
        "causal_per_cell": causal_per_cell(costs[main].clocks, masked, tiles.block_m, tiles.block_n),
        "unknown": throughput.unknown_opcodes(instructions),
    }


def report(arch: int, head_dim: int, dtype: torch.dtype, dropout: float, cases: List[str],
           directions: List[str]) -> List[dict]:
    """The rows of one architecture and head width: the baseline's kernels, then each case's, per direction."""
    compiled: Dict[tuple, dict] = {}  # (kernel, constants) -> its row, for kernels two cases share
    rows, tiles_of = [], {}
    for key in cases:
        for direction, launch in fused_launches(CASES[key], dtype, head_dim, dropout):
            if direction not in directions:
                continue
            identity = (launch.name, tuple(sorted(launch.constants.items())))
            if identity not in compiled:
                candidates = fused.settings(launch.name, launch.constants["BLOCK_D"], dtype, arch // 10)
                tiles, kernel = cross_compile.first_fitting(launch, candidates, arch)
                compiled[identity] = dict(kernel_cost(kernel, tiles, arch, launch.name), case=CASES[key].label)
                tiles_of.setdefault(direction, tiles)
            first = compiled[identity]
            rows.append(dict(first, case=CASES[key].label, direction=direction,
                             own_work=own_work(CASES[key], direction),
                             same_as=None if first["case"] == CASES[key].label else first["case"]))
    baseline, baseline_kernels = [], {}
    for direction, launch in baseline_launches(dtype, head_dim, dropout):
        if direction in tiles_of:
            kernel = baseline_kernels[direction] = cross_compile.compile_launch(launch, tiles_of[direction], arch)
            baseline.append(dict(kernel_cost(kernel, tiles_of[direction], arch, launch.name), case=BASELINE,
                                 direction=direction, same_as=None,
                                 fits=kernel.metadata.shared <= cross_compile.SHARED_MEMORY[arch]))
    for row in baseline + rows:
        reference = sum(b["per_cell"] for b in baseline if b["direction"] == row["direction"])
        causal = sum(b["causal_per_cell"] for b in baseline if b["direction"] == row["direction"])
        row.update(ratio=row["per_cell"] / reference, causal_ratio=row["causal_per_cell"] / causal)
        if row["case"] != BASELINE:
            floor = floor_cost(baseline_kernels[row["direction"]], tiles_of[row["direction"]], arch, row["own_work"])
            row.update(floor=floor, floor_ratio=floor["causal_per_cell"] / causal,
                       over_floor=row["causal_per_cell"] / floor["causal_per_cell"])
    return baseline + rows


def model_text(arches: List[int]) -> str:
    """The throughput model's numbers, one line an architecture."""
    lines = []
    for arch in arches:
        sm = throughput.SMS[arch]
        fp32 = sm.fp32_clocks / sm.fma_halves
        lines.append(f"{sm.name}: 4 sub-partitions, each issuing 1 warp instruction a clock; the clocks a warp "
                     f"instruction takes of its sub-partition's pipe: FP32 on the FMA pipe {fp32:g}, IMAD "
                     f"{sm.imad_clocks}, ALU {sm.alu_clocks}, SFU {sm.sfu_clocks}; tensor cores {sm.tensor_flops} "
                     f"FLOP a clock an SM; the shared-memory data path {throughput.DATA_PATH_BYTES} bytes a clock an "
                     "SM. A loop's clocks: the largest bound.")
    return "\n".join(lines)


def table(rows: List[dict]) -> str:
    """The rows as a Markdown table."""
    classes = ("tensor", "fma", "alu", "sfu", "memory", "other")
    head = ["kernel", "case", "tiles", "regs", "spills st/ld B", "shared KB", "main loop instr",
            *classes, "bound", "clk/cell", "clk/cell causal", "x FA2", "x FA2 causal", "floor x FA2 causal",
            "x floor causal"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        loop = row["loops"][row["main"]]
        tiles = row["tiles"]
        case = row["case"] + (f" (= {row['same_as']})" if row["same_as"] else "")
        shared = f"{row['shared'] / 1024:.0f}" + ("" if row.get("fits", True) else " (over)")
        cells = [f"{row['direction']} ({row['kernel']})", case,
                 f"{tiles['block_m']}x{tiles['block_n']}/{tiles['num_warps']}w/{tiles['num_stages']}s",
                 str(row["registers"]),
                 f"{row['spill_stores']}/{row['spill_loads']}", shared, str(loop["instructions"]),
                 *(str(loop["classes"][c] + (loop["classes"]["unknown"] if c == "other" else 0)) for c in classes),
                 loop["binding"], f"{row['per_cell']:.3f}", f"{row['causal_per_cell']:.3f}", f"{row['ratio']:.2f}",
                 f"{row['causal_ratio']:.2f}", *((f"{row['floor_ratio']:.2f}", f"{row['over_floor']:.2f}")
                                                 if "floor" in row else ("", ""))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def leading_opcodes(rows: List[dict]) -> str:
    """Each distinct kernel's main loop: its bounds and its most frequent opcodes."""
    lines = []
    for row in rows:
        if row["same_as"]:
            continue
        loop = row["loops"][row["main"]]
        bounds = ", ".join(f"{name} {loop['bounds'][name]:.0f}" for name in throughput.BOUNDS)
        opcodes = ", ".join(f"{name} {count}" for name, count in list(loop["opcodes"].items())[:LEADING])
        unknown = f"; not in the model: {', '.join(row['unknown'])}" if row["unknown"] else ""
        lines.append(f"- {row['direction']} {row['case']}: {len(row['loops'])} tensor-core loops of "
                     f"{'/'.join(str(l['instructions']) for l in row['loops'])} instructions; main loop's clocks "
                     f"a tile: {bounds}; {opcodes}{unknown}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, nargs="+", default=[80, 90], choices=sorted(throughput.SMS))
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    p.add_argument("--directions", nargs="+", choices=["forward", "backward"], default=["forward", "backward"])
    p.add_argument("--json", help="write the settings, the model and every kernel's figures here")
    args = p.parse_args(argv)
    cross_compile.check_compiler()
    dtype = getattr(torch, args.dtype)
    print(f"python -m gpu_tools.kernel_cost {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(model_text(args.arch))
    results = []
    for arch in args.arch:
        for head_dim in args.head_dims:
            rows = report(arch, head_dim, dtype, args.dropout, args.cases, args.directions)
            results.append(dict(arch=arch, head_dim=head_dim, rows=rows))
            print(f"\n### sm_{arch}, heads of {head_dim}, {args.dtype}, dropout {args.dropout}, causal at {LENGTH} "
                  f"tokens\n\n{table(rows)}\n\n{leading_opcodes(rows)}", flush=True)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(dict(settings=dict(vars(args), length=LENGTH, batch=BATCH, heads=HEADS),
                           model={arch: throughput.SMS[arch]._asdict() for arch in args.arch},
                           model_text=model_text(args.arch), results=results), file, indent=1)


if __name__ == "__main__":
    main()
