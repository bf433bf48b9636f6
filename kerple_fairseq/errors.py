"""The plugin's user-facing errors, reported as one line on the command line."""

import argparse
import sys


class KernelConfigError(ValueError):
    """A bad kernel name, option value or model configuration.

    The message says what is wrong and what to do. Uncaught, it is printed as a
    single ``kerple_fairseq: error: ...`` line (exit status 1) instead of a
    traceback (see :func:`install_excepthook`).
    """


class UsageError(Exception):
    """A problem with a command's input (paths, data, lengths); its command prints it as one line."""


def _one_line_excepthook(previous):
    def hook(exc_type, exc, tb):
        if issubclass(exc_type, KernelConfigError):
            print(f"kerple_fairseq: error: {exc}", file=sys.stderr)
        else:
            previous(exc_type, exc, tb)

    hook.kerple_fairseq = True
    return hook


def _one_line_usage_error(parser: argparse.ArgumentParser, message: str) -> None:
    parser.exit(2, f"{parser.prog}: error: {message} (options: {parser.prog} --help)\n")


def install_one_line_errors() -> None:
    """Print uncaught :class:`KernelConfigError` as one line, and command-line errors of every parser in
    the process (fairseq-train's with ``--user-dir kerple_fairseq``, kerple-eval-lm's, kerple-analyze's)
    as one line, without the usage listing that ``--help`` gives; other errors are untouched."""
    if not getattr(sys.excepthook, "kerple_fairseq", False):
        sys.excepthook = _one_line_excepthook(sys.excepthook)
    argparse.ArgumentParser.error = _one_line_usage_error
