"""Compile the fused backend's kernels for a GPU on a machine without one (Triton's compiler down to the GPU's
binary, no device needed), as the backend launches them, and report each launch settings' shared memory.

    python tests/fused_compile.py --dtype float16 --head-dim 128 --arch 80 --limits 166912 101376 [--plain]

The launches are recorded from the backend's own forward and backward (:func:`kerple_core.attention.fused.launch`
replaced by a recorder, so nothing runs): every flag on (a weight kernel, gates, padding, dropout), or, with
``--plain``, every flag off. For each of :data:`~kerple_core.attention.fused.TILES` in turn, every recorded
kernel is compiled for ``sm_ARCH``, until, for each of ``--limits`` (bytes of shared memory a block), settings
whose kernels all fit. Prints JSON: ``{"fits": {limit: index or null}, "tried": [[index, {kernel: shared bytes}],
...]}``. Run in its own process, without ``TRITON_INTERPRET``, which the test process sets.
"""

import argparse
import json
import os

import torch


def recorded_launches(dtype, head_dim, plain):
    """``[(kernel name, args, constants)]`` of one forward and backward of the backend."""
    from kerple_core.attention import fused
    launches = []
    fused.launch = lambda name, programs, batch_heads, device, args, constants: \
        launches.append((name, args, constants))
    q, k, v = (torch.randn(1, 2, 8, head_dim, dtype=dtype).requires_grad_() for _ in range(3))
    values = torch.randn(2, 8, requires_grad=True)
    weight = None if plain else torch.randn(2, 8, requires_grad=True)
    gates = None if plain else torch.randn(1, 2, 8, requires_grad=True)
    padding = None if plain else torch.zeros(1, 8, dtype=torch.int8)
    out = fused._FusedAttention.apply(q, k, v, values, weight, gates, padding, 0, 0, 0.0 if plain else 0.1, 3)
    out.float().sum().backward()
    return launches


POINTERS = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.int8: "*i8"}


def compiled_shared_memory(name, args, constants, tiles, arch):
    """The shared memory a block of kernel ``name`` takes, compiled for ``sm_ARCH`` with ``tiles``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kerple_core.attention.fused import kernels
    kernel = getattr(kernels(), name)
    constants = dict(constants, UPCAST=False, BLOCK_M=tiles.block, BLOCK_N=tiles.block)  # UPCAST: the interpreter's
    signature = {}
    for arg_name, value in zip(kernel.arg_names, args):
        if isinstance(value, torch.Tensor):
            signature[arg_name] = POINTERS[value.dtype]
        else:
            signature[arg_name] = "fp32" if isinstance(value, float) else "i32"
    signature.update({constant: "constexpr" for constant in constants})
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants),
                              target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": tiles.num_warps, "num_stages": tiles.num_stages})
    return compiled.metadata.shared


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], required=True)
    p.add_argument("--head-dim", type=int, required=True)
    p.add_argument("--arch", type=int, required=True, help="compute capability, e.g. 90 for sm_90")
    p.add_argument("--limits", type=int, nargs="+", required=True,
                   help="shared memory a block may take, in bytes: one for each GPU of this architecture's binary")
    p.add_argument("--plain", action="store_true", help="every flag off")
    args = p.parse_args()
    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "compiling needs Triton's compiler, not its interpreter"
    from kerple_core.attention.fused import TILES
    launches = recorded_launches(getattr(torch, args.dtype), args.head_dim, args.plain)
    # the backward over keys first: the most shared memory, so a setting too large is refused at once
    launches.sort(key=lambda launch: launch[0] != "backward_keys_kernel")
    tried, fits = [], {limit: None for limit in args.limits}
    for index, tiles in enumerate(TILES):
        shared = {}
        for name, launch_args, constants in launches:
            shared[name] = compiled_shared_memory(name, launch_args, constants, tiles, args.arch)
            if shared[name] > max(limit for limit, fit in fits.items() if fit is None):
                break  # too large for every GPU still without settings
        tried.append([index, shared])
        if len(shared) == len(launches):
            for limit, fit in fits.items():
                if fit is None and max(shared.values()) <= limit:
                    fits[limit] = index
        if all(fit is not None for fit in fits.values()):
            break
    print(json.dumps({"fits": fits, "tried": tried}))


if __name__ == "__main__":
    main()
