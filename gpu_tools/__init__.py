"""Deployment tooling for a GPU machine without network (not installed with the plugin): the bundle it
installs from (:mod:`gpu_tools.bundle`) and the one bounded command that checks the plugin there
(:mod:`gpu_tools.check`). Run through ``scripts/prepare-gpu-bundle.sh`` and ``scripts/gpu-check.sh``.

Beside it, analysis that needs no GPU: the fused attention kernels' cost read from their machine code
(:mod:`gpu_tools.kernel_cost`), compiled for GPUs on a CPU (:mod:`gpu_tools.cross_compile`), against a
FlashAttention-2-style baseline (:mod:`gpu_tools.flash_reference`)."""
