#!/usr/bin/env bash
# Set up ./.venv if needed, then run the small comparison of position encodings on CPU.
#   bash scripts/run-small-comparison.sh [options]                  # downloads WikiText-103 once into downloads/
#   WIKITEXT103_DIR=DIR bash scripts/run-small-comparison.sh [options]  # DIR holding wiki.{train,valid,test}.tokens
# Options are those of scripts/small_comparison.py (--help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
exec .venv/bin/python scripts/small_comparison.py "$@"
