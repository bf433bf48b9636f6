#!/usr/bin/env bash
# The GPU checks in one bounded command, on a machine with CUDA and no network (options: --help; docs/gpu.md).
#   bash scripts/gpu-check.sh --results DIR   # on the GPU machine, gpu-bundle/ carried in the checkout
#   bash scripts/gpu-check.sh --rehearse      # here: every step in .gpu-rehearsal/, the GPU image's stack minus CUDA
#   bash scripts/gpu-check.sh --dry-run       # anywhere: check the bundle, print the commands
# On the GPU machine it runs the Python that holds its PyTorch (python3, or $PYTHON); a rehearsal,
# .gpu-rehearsal/'s (made on its first run from $PYTHON312, default python3.12); a dry run, ./.venv's.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
if [[ " $* " == *" --dry-run "* ]]; then
  source "$here/python-env.sh"  # ./.venv, set up on the first run
elif [[ " $* " == *" --rehearse "* ]]; then
  env_dir="$here/../.gpu-rehearsal"
  py="$env_dir/bin/python"
  if [ ! -x "$py" ]; then
    "${PYTHON312:-python3.12}" -m venv "$env_dir"
    "$py" -m pip install -q --upgrade pip
    # the GPU image's versions (gpu_tools/bundle.py's IMAGE): torch's CUDA build, which runs on a CPU
    "$py" -m pip install -q $(cd "$here/.." && "$py" -c "from gpu_tools.bundle import IMAGE; print(*IMAGE)")
  fi
else
  py="${PYTHON:-python3}"
fi
exec "$py" "$here/gpu_check.py" "$@"
