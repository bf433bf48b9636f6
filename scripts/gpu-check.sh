#!/usr/bin/env bash
# The GPU checks in one command, on a machine with CUDA and no network (options: --help; docs/gpu.md).
#   bash scripts/gpu-check.sh --results DIR      # on the GPU machine, gpu-bundle/ carried in the checkout
#   bash scripts/gpu-check.sh --dry-run          # anywhere: prepare and check the bundle, print the commands
# On the GPU machine it runs the Python that holds its PyTorch (python3, or $PYTHON); a dry run, ./.venv's.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
if [[ " $* " == *" --dry-run "* ]]; then
  source "$here/python-env.sh"  # ./.venv, set up on the first run
else
  py="${PYTHON:-python3}"
fi
exec "$py" "$here/gpu_check.py" "$@"
