# Sourced by the entry scripts: sets $py to ./.venv's Python, creating ./.venv first if it lacks fairseq.
py="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv/bin/python"
if ! { [ -x "$py" ] && "$py" -c "import importlib.util as u, sys; sys.exit(u.find_spec('fairseq') is None)"; }; then
  bash "$(dirname "${BASH_SOURCE[0]}")/setup-env.sh"
fi
