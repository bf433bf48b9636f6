#!/usr/bin/env python
"""Kernel curves, effective lengths, position-wise perplexity and receptive fields of checkpoints;
the same as the installed ``kerple-analyze`` command (``--help`` for the analyses and options)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kerple_fairseq.analysis.cli import cli_main  # noqa: E402

if __name__ == "__main__":
    cli_main()
