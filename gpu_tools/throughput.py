"""A throughput model of one GPU streaming multiprocessor (SM), applied to a loop body of SASS: the clocks a block's
warps need for one pass of it if nothing but throughput limited them.

The SM has 4 sub-partitions; a block's warps are spread evenly over them and each warp runs the whole body. A
sub-partition issues one warp instruction a clock and each of its pipes takes a warp instruction every few
clocks; the tensor cores and the shared-memory data path are counted for the whole SM. The body's clocks are the
largest of these bounds (the one that binds):

- ``issue``: every instruction, 1 clock a warp instruction (on its sub-partition);
- ``fma``: the FMA pipe, two halves of 16 lanes on sm_90 (H100): FP32 ``FFMA``/``FADD``/``FMUL`` and packed
  half ``HFMA2``/``HADD2``/``HMUL2`` go to either half (1 clock a warp instruction, both halves together), ``IMAD``
  and ``IMUL`` (every variant, moves such as ``IMAD.MOV`` included) only to the heavy half (2 clocks): clocks =
  max(2 IMAD, IMAD + FP32 + half). On sm_80 (A100) one 16-lane pipe: 2 clocks for FP32 and IMAD, 1 for packed
  half (which the A100 runs on a pipe of its own: counted here, a small overcount);
- ``alu``: integer, logic, compare, select and min/max (``IADD3``, ``LOP3``, ``SHF``, ``ISETP``, ``FSETP``,
  ``FSEL``, ``SEL``, ``FMNMX``, ``PRMT``, ``LEA``, ``VIADD``, the fast FP32-to-FP16 packing ``F2FP``, ...): 2 clocks;
- ``sfu``: the special-function unit, ``MUFU.*`` (``EX2``, ``RCP``, ``LG2``, ...) and conversions (``F2F``,
  ``I2F``, ``F2I``, ``FRND``): 8 clocks (16 results a clock an SM);
- ``tensor``: ``HMMA.MNK`` is ``2 M N K`` FLOP a warp instruction, ``HGMMA.MxNxK`` ``2 M N K`` a warp group of
  4 warps (a quarter a warp); an SM does 4096 FP16/BF16 FLOP a clock on sm_90 (H100 SXM: 989 TFLOPS dense at
  1.83 GHz on 132 SMs) and 2048 on sm_80 (A100: 312 TFLOPS at 1.41 GHz on 108 SMs), TF32 at half that;
- ``shared``: the SM's L1/shared-memory data path, 128 bytes a clock: a warp instruction of ``LDS``, ``STS``,
  ``LDSM``, ``STSM``, ``LDGSTS``, ``LDG``, ``STG``, ``LDL``, ``STL``, ``RED``, ``ATOM`` takes
  max(1, bytes / 128) clocks (a conflict-free access: 32 threads times the width its modifiers say, ``.128``: 16
  bytes; ``LDSM``/``STSM``: 128 bytes a 8x8 matrix), ``SHFL`` 1; ``LDC`` none (the constant cache).

Everything else (branches, barriers, ``DEPBAR``, ``WARPGROUP``, ``NOP``, moves, ``S2R``/``CS2R``, ``R2UR`` and the
uniform datapath's ``U*``) takes issue slots only, as do opcodes this model does not know, which are listed.

A model is not a clock: it leaves out latency (dependent instructions, ``HGMMA`` and barrier waits, a warp waiting
on its loads), occupancy (how many warps hide that latency), the L2 and HBM bandwidth, the throughput of atomics
at L2, shared-memory bank conflicts, ``HGMMA`` reading its operands from shared memory, dual issue and the
scheduler's choices. ``HMMA`` (``mma.sync``) on sm_90 is counted at ``HGMMA``'s rate, which it does not reach.
"""

import re
from typing import Dict, List, NamedTuple

from gpu_tools.sass import Instruction

#: the opcodes (the name before the first dot) of each class; any other is "other" and takes issue slots only
CLASSES = {
    "tensor": {"HMMA", "HGMMA", "IMMA", "IGMMA", "DMMA", "BMMA", "QGMMA"},
    "fma": {"FFMA", "FADD", "FMUL", "FFMA32I", "FADD32I", "FMUL32I", "HFMA2", "HADD2", "HMUL2", "HFMA2_32I",
            "HADD2_32I", "HMUL2_32I", "IMAD", "IMUL", "IMAD32I", "IMUL32I", "IDP"},
    "alu": {"IADD3", "IADD", "IADD32I", "IABS", "LOP3", "LOP", "LOP32I", "SHF", "SHL", "SHR", "ISETP", "ICMP",
            "IMNMX", "VIMNMX", "VIADD", "VIADDMNMX", "LEA", "ISCADD", "SEL", "FSEL", "FSETP", "FSET", "FMNMX",
            "HSETP2", "HSET2", "HMNMX2", "PRMT", "PLOP3", "PSETP", "P2R", "R2P", "F2FP", "I2FP", "F2IP", "SGXT",
            "BMSK", "BREV", "FLO", "POPC", "BFE", "BFI", "FCHK"},
    "sfu": {"MUFU", "F2F", "I2F", "F2I", "FRND", "I2I"},
    "memory": {"LDS", "STS", "LDSM", "STSM", "LDGSTS", "LDG", "STG", "LD", "ST", "LDL", "STL", "RED", "REDG", "ATOM",
               "ATOMG", "ATOMS", "SHFL", "LDC", "UBLKCP", "UTMALDG", "UTMASTG", "UTMAPF", "MATCH", "CCTL"},
    "other": {"BRA", "BRX", "JMP", "JMX", "EXIT", "RET", "CALL", "BAR", "BSSY", "BSYNC", "WARPSYNC", "NOP", "DEPBAR",
              "LDGDEPBAR", "WARPGROUP", "MEMBAR", "ERRBAR", "FENCE", "YIELD", "S2R", "S2UR", "CS2R", "R2UR", "MOV",
              "VOTE", "VOTEU", "ELECT", "SYNCS", "BPT", "KILL", "B2R", "R2B", "ACQBULK", "ENDCOLLECTIVE"},
}
#: the ``fma`` opcodes only the heavy half of sm_90's FMA pipe runs
HEAVY = {"IMAD", "IMUL", "IMAD32I", "IMUL32I", "IDP"}
#: packed half-precision ``fma`` opcodes
HALF = {"HFMA2", "HADD2", "HMUL2", "HFMA2_32I", "HADD2_32I", "HMUL2_32I"}
#: memory opcodes that do not go through the L1/shared-memory data path
NO_DATA_PATH = {"LDC", "UBLKCP", "UTMALDG", "UTMASTG", "UTMAPF", "CCTL"}
#: bytes of the shared-memory data path an SM moves a clock
DATA_PATH_BYTES = 128
#: the bounds, in the order printed
BOUNDS = ("issue", "fma", "alu", "sfu", "tensor", "shared")


class SM(NamedTuple):
    """One SM's throughputs: tensor FLOP a clock (FP16/BF16 dense), the FMA pipe's halves and the clocks of a warp
    instruction of FP32 and of IMAD on one half, of packed half, of the ALU and of the SFU."""

    name: str
    tensor_flops: int
    fma_halves: int
    fp32_clocks: int
    imad_clocks: int
    half_clocks: int
    alu_clocks: int
    sfu_clocks: int


#: the model of each architecture's SM
SMS = {
    90: SM("H100 SM (sm_90)", 4096, 2, 2, 2, 2, 2, 8),
    80: SM("A100 SM (sm_80)", 2048, 1, 2, 2, 1, 2, 8),
}


class Cost(NamedTuple):
    """A loop body's cost for one tile of ``cells`` cells run by ``warps`` warps: its instructions a warp, their
    count by class, the block's tensor-core FLOP, the bounds in clocks of the SM, the one that binds, and its clocks
    a cell."""

    instructions: int
    classes: Dict[str, int]
    flops: int
    bounds: Dict[str, float]
    binding: str
    clocks: float
    per_cell: float


def base(opcode: str) -> str:
    """The opcode's name without its modifiers: ``IMAD`` of ``IMAD.MOV.U32``."""
    return opcode.split(".")[0]


def classify(opcode: str) -> str:
    """The class of ``opcode``: one of :data:`CLASSES`' keys, the uniform datapath's ``U*`` in ``other``, and
    ``unknown`` for an opcode the model does not know (counted in ``other`` by :func:`loop_cost`)."""
    name = base(opcode)
    for kind, names in CLASSES.items():
        if name in names:
            return kind
    return "other" if name.startswith("U") else "unknown"


def tensor_flops(opcode: str) -> int:
    """FLOP of one warp's tensor-core instruction: ``HMMA.16816`` 16 x 8 x 16 x 2; ``HGMMA.64x64x16`` 64 x 64 x 16 x
    2 for its warp group of 4 warps, a quarter for each."""
    parts = opcode.split(".")
    if parts[0] == "HGMMA":
        m, n, k = (int(x) for x in parts[1].split("x"))
        return 2 * m * n * k // 4
    if parts[0] == "HMMA":
        shape = parts[1]
        return 2 * int(shape[:2]) * int(shape[2]) * int(shape[3:])
    raise ValueError(f"no FLOP count for tensor-core instruction {opcode}")


_WIDTH = re.compile(r"\.(128|64|32|U8|S8|U16|S16)(?:\.|$)")
_VECTOR = re.compile(r"\.(?:F|BF|S|U)(\d+)x(\d)(?:\.|$)")
_MATRICES = re.compile(r"\.MT?88(?:\.(\d))?")


def data_path_clocks(opcode: str) -> float:
    """Clocks of the SM's shared-memory data path one warp instruction of memory ``opcode`` takes (0 for those that
    do not use it)."""
    name = base(opcode)
    if name in NO_DATA_PATH:
        return 0.0
    if name == "SHFL":
        return 1.0
    if name in ("LDSM", "STSM"):
        matrices = _MATRICES.search(opcode)
        count = int(matrices.group(1) or 1) if matrices else 1
        return count * 128 / DATA_PATH_BYTES
    width, vector = _WIDTH.search(opcode), _VECTOR.search(opcode)
    if vector:  # a vector reduction: REDG.E.ADD.F32x4, four floats a thread
        per_thread = int(vector.group(1)) // 8 * int(vector.group(2))
    else:
        per_thread = {"128": 16, "64": 8}.get(width.group(1), 4) if width else 4
    return max(1.0, per_thread * 32 / DATA_PATH_BYTES)


def loop_cost(body: List[Instruction], warps: int, cells: int, sm: SM) -> Cost:
    """The cost of one pass of ``body`` (a loop's instructions, once each) by ``warps`` warps over a tile of
    ``cells`` cells, under ``sm``'s model."""
    classes = {kind: 0 for kind in (*CLASSES, "unknown")}
    fp32 = imad = half = 0
    flops = tensor_clocks = shared = 0
    for instruction in body:
        kind = classify(instruction.opcode)
        classes[kind] += 1
        name = base(instruction.opcode)
        if kind == "fma":
            imad += name in HEAVY
            half += name in HALF
            fp32 += name not in HEAVY and name not in HALF
        elif kind == "tensor":
            work = tensor_flops(instruction.opcode)
            flops += work
            tensor_clocks += work * (2 if ".TF32" in instruction.opcode else 1)
        elif kind == "memory":
            shared += data_path_clocks(instruction.opcode)
    per_partition = warps / 4
    heavy = imad * sm.imad_clocks
    either = fp32 * sm.fp32_clocks + half * sm.half_clocks
    bounds = {
        "issue": len(body) * per_partition,
        "fma": max(heavy, (heavy + either) / sm.fma_halves) * per_partition,
        "alu": classes["alu"] * sm.alu_clocks * per_partition,
        "sfu": classes["sfu"] * sm.sfu_clocks * per_partition,
        "tensor": tensor_clocks * warps / sm.tensor_flops,
        "shared": shared * warps,
    }
    binding = max(BOUNDS, key=lambda name: bounds[name])
    return Cost(len(body), classes, flops * warps, bounds, binding, bounds[binding], bounds[binding] / cells)


def unknown_opcodes(body: List[Instruction]) -> List[str]:
    """The opcodes of ``body`` the model does not know, once each."""
    return sorted({i.opcode for i in body if classify(i.opcode) == "unknown"})
