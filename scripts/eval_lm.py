#!/usr/bin/env python
"""Evaluate a checkpoint under the early-token-cursed, sliding and last-token protocols at many
lengths; the same as the installed ``kerple-eval-lm`` command (``--help`` for the options)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kerple_fairseq.evaluation.cli import cli_main  # noqa: E402

if __name__ == "__main__":
    cli_main()
