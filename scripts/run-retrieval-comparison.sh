#!/usr/bin/env bash
# Set up ./.venv if needed, then run the retrieval comparison of position encodings on CPU.
#   bash scripts/run-retrieval-comparison.sh [options]    # options: scripts/retrieval_comparison.py --help
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
exec .venv/bin/python scripts/retrieval_comparison.py "$@"
