"""Deployment tooling for a GPU machine without network (not installed with the plugin): the bundle it
installs from (:mod:`gpu_tools.bundle`) and the one bounded command that checks the plugin there
(:mod:`gpu_tools.check`). Run through ``scripts/prepare-gpu-bundle.sh`` and ``scripts/gpu-check.sh``."""
