#!/usr/bin/env bash
# ALiBi's WikiText-103 recipe for one model (a position encoding or a kernel), on every GPU of this machine (options: --help).
#   bash scripts/train-wikitext-103.sh kerple_log                  # 16 layers, fp16, 286k updates
#   bash scripts/train-wikitext-103.sh alibi --tiny --cpu-processes 2   # CPU smoke run, two gloo processes
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/python-env.sh"  # ./.venv, set up on the first run
exec "$py" "$here/train_wikitext_103.py" "$@"
