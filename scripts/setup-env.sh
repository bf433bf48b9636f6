#!/usr/bin/env bash
# Create ./.venv and install kerple-fairseq with its dependencies into it. Idempotent.
#   PYTHON=python3.10 bash scripts/setup-env.sh   # choose the interpreter
set -euo pipefail
cd "$(dirname "$0")/.."
# the Pythons the set-up was tried on (torch 2.13.0 has no build for 3.9 and older)
supported='import sys; sys.exit(not (3, 10) <= sys.version_info[:2] <= (3, 13))'
if [ ! -x .venv/bin/python ]; then
  if ! "${PYTHON:-python3}" -c "$supported" 2>/dev/null; then
    echo "setup-env: error: kerple-fairseq needs Python 3.10 to 3.13; ${PYTHON:-python3} is $("${PYTHON:-python3}" -V 2>&1 || echo 'not found'): choose another with PYTHON=python3.12 bash scripts/setup-env.sh" >&2
    exit 1
  fi
  "${PYTHON:-python3}" -m venv .venv
elif ! .venv/bin/python -c "$supported"; then
  echo "setup-env: error: .venv holds $(.venv/bin/python -V 2>&1); kerple-fairseq needs Python 3.10 to 3.13: remove .venv and run again with PYTHON=python3.12" >&2
  exit 1
fi
py=.venv/bin/python
if "$py" -c "import fairseq" 2>/dev/null; then
  echo "setup-env: updating $(pwd)/.venv" >&2
else
  echo "setup-env: installing into $(pwd)/.venv (fairseq is built from source unless pip has its wheel cached: up to about 6 min on 2 cores)" >&2
fi
"$py" -m pip install -q --upgrade pip setuptools wheel
# Pinned: an unpinned torch resolves to a multi-GB CUDA build. NumPy: what pip resolves (NumPy 2 today).
"$py" -m pip install -q "torch==2.13.0" numpy cython
# fairseq's build imports torch, so build it against the torch above (no isolated build env,
# which would fetch another torch). setup.py asks for fairseq-fixed, fairseq 0.12.2's rebuild.
# editable: every command (kerple-eval-lm, kerple-analyze, fairseq-train --user-dir kerple_fairseq) runs
# this checkout's code, edits included
"$py" -m pip install -q --no-build-isolation -e ".[test,plots]"
# Triton, for the tests of the fused attention backend (its interpreter runs the kernels on CPU tensors); a
# Triton already there (a CUDA PyTorch's own) is kept. 3.8: 3.6's interpreter fails on NumPy 2.4
if ! "$py" -c "import triton" 2>/dev/null; then
  "$py" -m pip install -q "triton==3.8.0"
fi
# fairseq resolves `--user-dir kerple_fairseq` given outside this folder beside its own package: a link
# there to this checkout's folder (the same files) lets that spelling work from any directory
link="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/kerple_fairseq"
if [ -e "$link" ] && [ ! -L "$link" ]; then
  echo "setup-env: error: $link is a copy of the plugin, not this checkout's: remove it and run again" >&2
  exit 1
fi
ln -sfn "$(pwd)/kerple_fairseq" "$link"
# fairseq's compiled parts must match the NumPy installed: a wheel pip cached from a build against
# another NumPy does not load, and is rebuilt (and cached in its place)
if ! "$py" -c "import fairseq.data.data_utils_fast, fairseq.data.token_block_utils_fast" 2>/dev/null; then
  echo "setup-env: rebuilding fairseq against NumPy $("$py" -c 'import numpy; print(numpy.__version__)')" >&2
  installed="$("$py" -c "from importlib import metadata as m; print([f'{d.name}=={d.version}' for d in m.distributions() if d.name in ('fairseq-fixed', 'fairseq')][0])")"
  name="${installed%%==*}"
  "$py" -m pip cache remove "${name//-/_}" -q 2>/dev/null || true  # the stale wheel; the new build is cached
  "$py" -m pip install -q --no-build-isolation --no-deps --force-reinstall "$installed"
fi
"$py" -c "import kerple_fairseq, fairseq, numpy, torch; print('setup-env: fairseq', fairseq.__version__, 'torch', torch.__version__, 'numpy', numpy.__version__)" 2>&1 | grep setup-env
