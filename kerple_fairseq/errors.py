"""The plugin's user-facing errors, reported as one line on the command line.

This module is the package's ground floor: it imports nothing from the package (from the core beside it,
:class:`kerple_core.errors.KernelConfigError`, the core's one error type). It holds the
exception types, their wording, and the machinery that reports an uncaught error or a command-line
mistake as one line. What an error *is* is known where its subject lives, and registered here:

- :func:`register_one_line_report` adds a recogniser of uncaught errors (besides
  :class:`KernelConfigError`) that are reported as one line: a refused checkpoint
  (:func:`kerple_fairseq.evaluation.checkpoint_file.refused_checkpoint_report`), a lost process of a
  training run (:func:`kerple_fairseq.training.distributed.lost_peer_report`), a failed check of a
  fairseq command's options (:func:`fairseq_option_check_report`);
- :func:`register_usage_hint` adds what to say after a command-line error (the missing ``--task`` of
  the plugin's architectures: :func:`kerple_fairseq.models.transformer_lm_kerple.task_hint`).

:func:`kerple_fairseq.fairseq_changes.apply_all` installs the one-line reports and registers each of
these, in the order listed there.
"""

import argparse
import os
import re
import sys
import traceback
from typing import Callable, List, Optional, Sequence

from kerple_core.errors import KernelConfigError

ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

#: recognisers of uncaught errors reported as one line, in order of precedence: each takes an exception
#: and returns the text to print after ``kerple_fairseq: error: `` if it recognises it, else None; each
#: is asked of the exception and of those it was raised from or during (see :func:`register_one_line_report`)
one_line_reports: List[Callable[[BaseException], Optional[str]]] = []

#: what to add to a command-line error's message: each takes the message and the command's arguments
#: and returns text to append (``""`` for nothing; see :func:`register_usage_hint`)
usage_hints: List[Callable[[str, Sequence[str]], str]] = []


class UsageError(Exception):
    """A problem with a command's input (paths, data, lengths); its command prints it as one line."""


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message, without terminal colour codes (its type if it has none)."""
    lines = ANSI_ESCAPE.sub("", str(error)).strip().splitlines()
    return lines[0].strip() if lines else type(error).__name__


def fairseq_option_check_report(error: BaseException) -> Optional[str]:
    """The message of a failed ``assert`` in a fairseq command's own code (``fairseq_cli``), which checks
    the options given and says what to change (fairseq-train without ``--max-tokens`` or ``--batch-size``,
    fairseq-generate without ``--path``), or None for any other error."""
    if not isinstance(error, AssertionError) or not str(error).strip():
        return None
    if f"{os.sep}fairseq_cli{os.sep}" in raising_file(error):
        return first_line(error)
    return None


def raising_file(error: BaseException) -> str:
    """The path of the file whose code raised ``error`` (the last frame of its traceback), or "" without one."""
    frames = traceback.extract_tb(error.__traceback__)
    return frames[-1].filename if frames else ""


def register_one_line_report(recognise: Callable[[BaseException], Optional[str]]) -> None:
    """Report the uncaught errors ``recognise`` recognises as one line (after those registered before
    it; registering it again changes nothing)."""
    if recognise not in one_line_reports:
        one_line_reports.append(recognise)


def register_usage_hint(hint: Callable[[str, Sequence[str]], str]) -> None:
    """Append what ``hint`` says to command-line errors (registering it again changes nothing)."""
    if hint not in usage_hints:
        usage_hints.append(hint)


def option_value(argv: Sequence[str], *names: str) -> Optional[str]:
    """The value given to the option ``names`` (``--name value`` or ``--name=value``) in ``argv``, if any."""
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


def _in_chain(error: Optional[BaseException], found):
    """The first truthy ``found(e)`` for ``error`` and the exceptions it was raised from or during."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if found(error):
            return found(error)
        error = error.__cause__ or error.__context__
    return None


def one_line_report(error: BaseException) -> Optional[str]:
    """The one line an uncaught ``error`` is reported as, or None for a traceback: a
    :class:`KernelConfigError`'s or :class:`UsageError`'s message, else the first registered recogniser's that recognises
    ``error`` or an exception it was raised from or during."""
    if isinstance(error, (KernelConfigError, UsageError)):
        return f"kerple_fairseq: error: {error}"
    for recognise in one_line_reports:
        report = _in_chain(error, recognise)
        if report:
            return f"kerple_fairseq: error: {report}"
    return None


def _one_line_excepthook(previous):
    def hook(exc_type, exc, tb):
        report = one_line_report(exc) if isinstance(exc, BaseException) else None
        if report is not None:
            print(report, file=sys.stderr)
        else:
            previous(exc_type, exc, tb)

    hook.kerple_fairseq = True
    return hook


def _one_line_usage_error(parser: argparse.ArgumentParser, message: str) -> None:
    argv = sys.argv[1:]
    hint = "".join(hint(message, argv) for hint in usage_hints)
    parser.exit(2, f"{parser.prog}: error: {message}{hint} (options: {parser.prog} --help)\n")


def _one_line_job_failure(stock_return_value):
    def return_value(job):
        failure = getattr(job, "_return_value", None)
        report = one_line_report(failure) if isinstance(failure, BaseException) else None
        if report is not None and job.status.name == "FAILED":
            print(report, file=sys.stderr)
            raise SystemExit(1)
        return stock_return_value.fget(job)

    return_value.kerple_fairseq = True
    return property(return_value, stock_return_value.fset)


def report_hydra_jobs_in_one_line() -> None:
    """fairseq-hydra-train: a job that failed with an error :func:`one_line_report` recognises ends in
    that line and exit status 1, instead of Hydra's report of the job and its traceback (Hydra catches
    the job's errors, so :data:`sys.excepthook` never sees them)."""
    try:
        from hydra.core.utils import JobReturn
    except ImportError:
        return
    if not getattr(JobReturn.return_value.fget, "kerple_fairseq", False):
        JobReturn.return_value = _one_line_job_failure(JobReturn.return_value)


def install_one_line_errors() -> None:
    """Print uncaught :class:`KernelConfigError`, and the errors of :data:`one_line_reports`, as one
    line, and command-line errors of every parser in the process (fairseq-train's with ``--user-dir
    kerple_fairseq``, kerple-eval-lm's, kerple-analyze's) as one line with the :data:`usage_hints`,
    without the usage listing that ``--help`` gives; other errors are untouched."""
    if not getattr(sys.excepthook, "kerple_fairseq", False):
        sys.excepthook = _one_line_excepthook(sys.excepthook)
    argparse.ArgumentParser.error = _one_line_usage_error
