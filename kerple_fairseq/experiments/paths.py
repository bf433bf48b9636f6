"""Where the experiments find things: this checkout's plugin folder and scripts, and the fairseq
commands installed beside the running interpreter."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
USER_DIR = REPO / "kerple_fairseq"  # what fairseq's --user-dir names
SCRIPTS = REPO / "scripts"
BIN = Path(sys.executable).parent  # fairseq-preprocess, fairseq-train, ...
