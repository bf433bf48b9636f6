#!/usr/bin/env bash
# ALiBi vs KERPLE-log on WikiText-103 (KERPLE Table 10): train, evaluate, tabulate (options: --help).
#   bash scripts/reproduce-wikitext-103.sh                          # trained at 512
#   bash scripts/reproduce-wikitext-103.sh --train-lengths 512 2048
#   bash scripts/reproduce-wikitext-103.sh --models sinusoidal alibi kerple_log --seeds 1 2 3
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/python-env.sh"  # ./.venv, set up on the first run
exec "$py" "$here/reproduce_wikitext_103.py" "$@"
