#!/usr/bin/env bash
# Set up ./.venv if needed, then run the small comparison of position encodings on CPU.
#   WIKITEXT103_DIR=../shared/data/wikitext-103-sample bash scripts/run-small-comparison.sh [options]
# Options are those of scripts/small_comparison.py (--help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
exec .venv/bin/python scripts/small_comparison.py "$@"
