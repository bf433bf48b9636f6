#!/usr/bin/env bash
# Set up ./.venv if needed, then run the test suite. Tests read the WikiText-103 sample from
# $KERPLE_WIKITEXT_DIR, ../shared/data/wikitext-103-sample or downloads/wikitext-103-sample (the main job's).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
exec .venv/bin/python -m pytest -q tests "$@"
