"""A compiled kernel's machine code, read with the CUDA tools Triton bundles (no GPU needed): its registers and
spills from ``ptxas -v`` on its PTX (checked against ``cuobjdump -res-usage`` of its cubin), its SASS from
``nvdisasm`` of its cubin, and the SASS's loops.

A loop is found from a backward branch: a ``BRA`` to a label at or before it; its body is every instruction from
the label to the branch. Loops are listed in address order; a loop that holds another is kept too (the caller
chooses).
"""

import re
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional

_ADDRESS = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;?\s*$")
_LABEL = re.compile(r"^(\.L\w+):")
_TARGET = re.compile(r"`\((\.L\w+)\)")
_PREDICATE = re.compile(r"^@!?U?P[T0-9]+$")
_USED = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_STACK = re.compile(r"(\d+) bytes stack frame")
_USAGE = re.compile(r"REG:(\d+) STACK:(\d+)")


class Instruction(NamedTuple):
    """One SASS instruction: its byte ``address``, ``opcode`` with its modifiers (``HMMA.16816.F32``), the operands'
    text, and the address it branches to (None but for branches)."""

    address: int
    opcode: str
    operands: str
    target: Optional[int]


class Loop(NamedTuple):
    """A loop of the SASS: the instructions from its label (``start``) to its backward branch (``end``), once each."""

    start: int
    end: int
    body: List[Instruction]


class Resources(NamedTuple):
    """What ``ptxas -v`` says of a kernel: registers a thread, bytes of spill stores and loads a thread, stack frame."""

    registers: int
    spill_stores: int
    spill_loads: int
    stack: int


def tool(name: str) -> str:
    """The path of a CUDA tool Triton bundles (``ptxas``, ``nvdisasm``, ``cuobjdump``)."""
    from triton import knobs
    return getattr(knobs.nvidia, name).path


def gpu_name(arch: int) -> str:
    """The ``--gpu-name`` Triton's compiler gives ``ptxas`` for compute capability ``arch`` (``sm_90a`` for 90)."""
    from triton.backends.nvidia.compiler import sm_arch_from_capability
    return sm_arch_from_capability(arch)


def resources(ptx: str, cubin: bytes, arch: int) -> Resources:
    """The kernel's resources: ``ptx`` assembled again by ``ptxas -v`` with the options Triton's compiler gives it and
    its report read, checked against the registers and stack ``cuobjdump -res-usage`` reads in Triton's ``cubin``."""
    with tempfile.TemporaryDirectory() as folder:
        source, binary = Path(folder) / "kernel.ptx", Path(folder) / "kernel.cubin"
        source.write_text(ptx)
        proc = subprocess.run([tool("ptxas"), "-lineinfo", "-v", "--regAllocOptLevel=2", f"--gpu-name={gpu_name(arch)}",
                               str(source), "-o", str(binary)], capture_output=True, text=True, check=True)
        binary.write_bytes(cubin)
        usage = subprocess.run([tool("cuobjdump"), "-res-usage", str(binary)], capture_output=True, text=True,
                               check=True).stdout
    log = proc.stdout + proc.stderr
    used, spills, stack, compiled = _USED.search(log), _SPILLS.search(log), _STACK.search(log), _USAGE.search(usage)
    if not (used and spills and stack and compiled):
        raise RuntimeError(f"no registers, spills or stack frame in ptxas -v's report or cuobjdump's: {log} {usage}")
    found = Resources(int(used.group(1)), int(spills.group(1)), int(spills.group(2)), int(stack.group(1)))
    if (found.registers, found.stack) != (int(compiled.group(1)), int(compiled.group(2))):
        raise RuntimeError(f"ptxas -v gave {found}, not the compiled kernel's {compiled.group(0)}")
    return found


def disassemble(cubin: bytes) -> str:
    """The SASS of ``cubin`` (``nvdisasm -c``: code only)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        return subprocess.run([tool("nvdisasm"), "-c", file.name], capture_output=True, text=True, check=True).stdout


def parse(sass: str) -> List[Instruction]:
    """The instructions of ``nvdisasm``'s text, in address order, each branch's label replaced by its address."""
    instructions, labels, pending = [], {}, []
    for line in sass.splitlines():
        label = _LABEL.match(line.strip())
        match = _ADDRESS.match(line)
        if label:
            pending.append(label.group(1))
        if not match:
            continue
        address = int(match.group(1), 16)
        labels.update((name, address) for name in pending)
        pending = []
        words = match.group(2).split(None, 1)
        if words and _PREDICATE.match(words[0]):
            words = words[1:] and words[1].split(None, 1)
        if words:
            operands = words[1] if len(words) > 1 else ""
            target = _TARGET.search(operands)
            instructions.append(Instruction(address, words[0].rstrip(";"), operands, target and target.group(1)))
    return [i._replace(target=labels.get(i.target)) for i in instructions]


def loops(instructions: List[Instruction]) -> List[Loop]:
    """The loops of ``instructions`` (from :func:`parse`): one per backward branch, in address order."""
    found = []
    for branch in instructions:
        if branch.target is not None and branch.target <= branch.address:
            body = [i for i in instructions if branch.target <= i.address <= branch.address]
            found.append(Loop(branch.target, branch.address, body))
    return sorted(found, key=lambda loop: loop.start)


def innermost(found: List[Loop]) -> List[Loop]:
    """Those of ``found`` that hold no other of them."""
    return [loop for loop in found
            if not any(other is not loop and loop.start <= other.start and other.end <= loop.end for other in found)]


def opcode_counts(body: List[Instruction]) -> Dict[str, int]:
    """How many instructions of ``body`` have each opcode (with modifiers), most first."""
    counts: Dict[str, int] = {}
    for instruction in body:
        counts[instruction.opcode] = counts.get(instruction.opcode, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))
