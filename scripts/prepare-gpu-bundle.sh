#!/usr/bin/env bash
# Prepare gpu-bundle/, what scripts/gpu-check.sh installs on a GPU machine without network (options: --help).
# Needs access to PyPI; fast when the bundle is already complete.
#   bash scripts/prepare-gpu-bundle.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/python-env.sh"  # ./.venv, set up on the first run
exec "$py" "$here/prepare_gpu_bundle.py" "$@"
