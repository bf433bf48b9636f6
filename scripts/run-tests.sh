#!/usr/bin/env bash
# Set up ./.venv if needed, then run the test suite. Tests read the WikiText-103 sample from
# $KERPLE_WIKITEXT_DIR, ../shared/data/wikitext-103-sample or downloads/wikitext-103-sample (the main job's).
# The tests run in $KERPLE_TEST_WORKERS pytest-xdist workers (default 2; 0 runs them in this process);
# extra arguments go to pytest (a later -n wins).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
# The suite starts several hundred Python processes; where PYTHONDONTWRITEBYTECODE is set, none would keep
# the checkout's compiled modules and each would compile them again (about 0.6 s a process): compile them once.
.venv/bin/python -m compileall -q kerple_core kerple_fairseq gpu_tools scripts tests
exec .venv/bin/python -m pytest -q -n "${KERPLE_TEST_WORKERS:-2}" --dist loadgroup tests "$@"
