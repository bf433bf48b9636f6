"""Compile the fused backend's kernels for a GPU on a machine without one (Triton's compiler down to the GPU's
binary, no device needed), as the backend launches them, and report each launch settings' shared memory.

    python tests/fused_compile.py --dtype float16 --head-dim 128 --arch 80 --limits 166912 101376 [--plain]

The launches are recorded from the backend's own forward and backward (:func:`kerple_core.attention.fused.launch`
replaced by a recorder, so nothing runs) and compiled as Triton compiles them at launch
(:mod:`gpu_tools.cross_compile`): every flag on (a weight kernel, gates, padding, dropout), or, with
``--plain``, every flag off. Each recorded kernel is compiled for ``sm_ARCH`` with each of its launch settings
(:func:`kerple_core.attention.fused.settings`) in turn, until, for each of ``--limits`` (bytes of shared memory a
block), one fits. Prints JSON: ``{"fits": {kernel: {limit: index or null}}, "tried": {kernel: [[index, shared
bytes], ...]}}``. Run in its own process, without ``TRITON_INTERPRET``, which the test process sets.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's gpu_tools
from gpu_tools.cross_compile import check_compiler, compile_launch, recorded  # noqa: E402


def recorded_launches(dtype, head_dim, plain):
    """The :class:`~gpu_tools.cross_compile.Launch` of each kernel of one forward and backward of the backend."""
    from kerple_core.attention import fused
    length = 256  # a multiple of 16, as a training length is: Triton specializes on it
    q, k, v = (torch.randn(1, 2, length, head_dim, dtype=dtype).requires_grad_() for _ in range(3))
    values = torch.randn(2, length, requires_grad=True)
    weight = None if plain else torch.randn(2, length, requires_grad=True)
    gates = None if plain else torch.randn(1, 2, length, requires_grad=True)
    padding = None if plain else torch.zeros(1, length, dtype=torch.int8)
    with recorded(fused, fused.kernels()) as launches:
        out = fused._FusedAttention.apply(q, k, v, values, weight, gates, padding, 0, 0, 0.0 if plain else 0.1, 3)
        out.float().sum().backward()
    # UPCAST: the interpreter's
    return [launch._replace(constants=dict(launch.constants, UPCAST=False)) for launch in launches]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], required=True)
    p.add_argument("--head-dim", type=int, required=True)
    p.add_argument("--arch", type=int, required=True, help="compute capability, e.g. 90 for sm_90")
    p.add_argument("--limits", type=int, nargs="+", required=True,
                   help="shared memory a block may take, in bytes: one for each GPU of this architecture's binary")
    p.add_argument("--plain", action="store_true", help="every flag off")
    args = p.parse_args()
    check_compiler()
    from kerple_core.attention.fused import settings
    dtype = getattr(torch, args.dtype)
    fits, tried = {}, {}
    for launch in recorded_launches(dtype, args.head_dim, args.plain):
        fits[launch.name] = {limit: None for limit in args.limits}
        tried[launch.name] = []
        for index, tiles in enumerate(settings(launch.name, launch.constants["BLOCK_D"], dtype, args.arch // 10)):
            shared = compile_launch(launch, tiles, args.arch).metadata.shared
            tried[launch.name].append([index, shared])
            for limit, fit in fits[launch.name].items():
                if fit is None and shared <= limit:
                    fits[launch.name][limit] = index
            if None not in fits[launch.name].values():
                break
    print(json.dumps({"fits": fits, "tried": tried}))


if __name__ == "__main__":
    main()
