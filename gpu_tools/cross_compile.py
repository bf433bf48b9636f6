"""Triton's compiler for a GPU on a machine without one: the kernels a backend launches, recorded from its own host
code (its ``launch`` function replaced by a recorder, so that nothing runs), each compiled down to the GPU's binary
as Triton compiles it at that launch: the arguments specialized by Triton's own binder (integers divisible by 16
and 16-byte aligned pointers marked so, integers equal to 1 made constants), for ``sm_ARCH``, with given tiles.

Needs Triton's compiler, not its interpreter: ``TRITON_INTERPRET`` unset (or 0) before Triton is imported.
"""

import contextlib
import os
from typing import Iterator, List, NamedTuple, Sequence, Tuple

from kerple_core.attention.fused import Tiles

#: shared memory a block may take on the largest GPU of each architecture, bytes: sm_80 (A100) 163 KiB, sm_90 (H100,
#: H200) 227 KiB
SHARED_MEMORY = {80: 166912, 90: 232448}


class Launch(NamedTuple):
    """A recorded launch: the kernel (a ``triton.jit`` function), its arguments and its compile-time constants
    (the tiles left out: the compilation chooses them)."""

    name: str
    kernel: object
    args: tuple
    constants: dict


def check_compiler() -> None:
    """Raise where Triton's interpreter, not its compiler, would run (``TRITON_INTERPRET=1``)."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("compiling for a GPU needs Triton's compiler: unset TRITON_INTERPRET")


@contextlib.contextmanager
def recorded(host, kernels) -> Iterator[List[Launch]]:
    """Within the block, ``host.launch(name, programs, batch_heads, device, args, constants, ...)`` records a
    :class:`Launch` of kernel ``name`` of module ``kernels`` into the list it yields, and runs nothing."""
    launches = []

    def record(name, programs, batch_heads, device, args, constants, *settings):
        launches.append(Launch(name, getattr(kernels, name), tuple(args), dict(constants)))

    original = host.launch
    host.launch = record
    try:
        yield launches
    finally:
        host.launch = original


def compile_launch(launch: Launch, tiles: Tiles, arch: int):
    """``launch``'s kernel compiled for ``sm_ARCH`` with ``tiles`` (``BLOCK_M`` x ``BLOCK_N``, warps, stages): Triton's
    ``CompiledKernel``, its PTX and cubin in ``asm``, its shared memory in ``metadata.shared``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    check_compiler()
    kernel = launch.kernel
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    settings = dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, _ = binder(*launch.args, **launch.constants, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
                                      **settings)
    options, signature, constexprs, attrs = kernel._pack_args(backend, settings, bound, specialization, None)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def first_fitting(launch: Launch, candidates: Sequence[Tiles], arch: int) -> Tuple[Tiles, object]:
    """The first of ``candidates`` whose compiled kernel's shared memory the largest GPU of ``sm_ARCH`` holds (as the
    backend's launch takes it), and that compiled kernel."""
    for tiles in candidates:
        compiled = compile_launch(launch, tiles, arch)
        if compiled.metadata.shared <= SHARED_MEMORY[arch]:
            return tiles, compiled
    raise RuntimeError(f"{launch.name}: none of the settings {list(candidates)} fits sm_{arch}'s shared memory")
