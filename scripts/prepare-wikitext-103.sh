#!/usr/bin/env bash
# Download, verify and preprocess WikiText-103 into data-bin/wikitext-103 (options: --help).
#   bash scripts/prepare-wikitext-103.sh                       # download from the official source
#   bash scripts/prepare-wikitext-103.sh --tokens-dir DIR      # offline, from wiki.*.tokens
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/python-env.sh"  # ./.venv, set up on the first run
exec "$py" "$here/prepare_wikitext_103.py" "$@"
