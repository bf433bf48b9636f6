"""The plugin's user-facing errors, reported as one line on the command line."""

import argparse
import re
import sys
from typing import Optional

ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class KernelConfigError(ValueError):
    """A bad kernel name, option value or model configuration.

    The message says what is wrong and what to do. Uncaught, it is printed as a
    single ``kerple_fairseq: error: ...`` line (exit status 1) instead of a
    traceback (see :func:`install_excepthook`).
    """


class UsageError(Exception):
    """A problem with a command's input (paths, data, lengths); its command prints it as one line."""


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message, without terminal colour codes (its type if it has none)."""
    lines = ANSI_ESCAPE.sub("", str(error)).strip().splitlines()
    return lines[0].strip() if lines else type(error).__name__


def _in_chain(error: Optional[BaseException], found):
    """The first truthy ``found(e)`` for ``error`` and the exceptions it was raised from or during."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if found(error):
            return found(error)
        error = error.__cause__ or error.__context__
    return None


# what a collective reports when another process of the run died or stopped answering (gloo, NCCL)
_LOST_PEER = re.compile(r"Connection (closed|reset) by peer|Timed out waiting|timed out|[Tt]imeout|"
                        r"NCCL communicator was aborted|Broken pipe")


def lost_peer(error: BaseException) -> Optional[str]:
    """The first line of ``error`` if it is a collective's report of a lost process."""
    import torch.distributed

    distributed = isinstance(error, getattr(torch.distributed, "DistError", ())) or "gloo" in str(error) or \
        "NCCL" in str(error) or "c10d" in str(error)
    if not (distributed and _LOST_PEER.search(str(error))):
        return None
    line = re.sub(r"^\[[^\]]*\]\s*", "", first_line(error))  # gloo's [source file:line]
    return line.split(". ")[0].rstrip(".")


def _one_line_excepthook(previous):
    def hook(exc_type, exc, tb):
        from kerple_fairseq.evaluation.checkpoint_file import refusal, refused_object

        refused = _in_chain(exc, refused_object)  # by fairseq's own load (--restore-file, checkpoint_last.pt)
        lost = _in_chain(exc, lost_peer)
        if issubclass(exc_type, KernelConfigError):
            print(f"kerple_fairseq: error: {exc}", file=sys.stderr)
        elif refused:
            print(f"kerple_fairseq: error: refused to read a checkpoint: {refusal(refused)}", file=sys.stderr)
        elif lost:
            print(f"kerple_fairseq: error: another process of this training run died or stopped answering "
                  f"({lost}); stopping. The same command resumes from checkpoint_last.pt in --save-dir",
                  file=sys.stderr)
        else:
            previous(exc_type, exc, tb)

    hook.kerple_fairseq = True
    return hook


def _option_value(argv, *names: str):
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


def _task_hint(message: str, argv) -> str:
    """A plugin architecture's language-model options refused because no --task was given: say so."""
    if "unrecognized arguments" not in message or _option_value(argv, "--task") is not None:
        return ""
    from fairseq.models import ARCH_MODEL_NAME_REGISTRY
    from kerple_fairseq.models.transformer_lm_kerple import MODEL_NAME, language_modeling_task_missing

    arch = _option_value(argv, "--arch", "-a")
    if ARCH_MODEL_NAME_REGISTRY.get(arch) != MODEL_NAME:
        return ""
    return f"; {language_modeling_task_missing(arch, 'translation')}"


def _one_line_usage_error(parser: argparse.ArgumentParser, message: str) -> None:
    hint = _task_hint(message, sys.argv[1:])
    parser.exit(2, f"{parser.prog}: error: {message}{hint} (options: {parser.prog} --help)\n")


def install_one_line_errors() -> None:
    """Print uncaught :class:`KernelConfigError`, and PyTorch's refusal of a checkpoint that asks for
    code, as one line, and command-line errors of every parser in
    the process (fairseq-train's with ``--user-dir kerple_fairseq``, kerple-eval-lm's, kerple-analyze's)
    as one line, without the usage listing that ``--help`` gives; other errors are untouched."""
    if not getattr(sys.excepthook, "kerple_fairseq", False):
        sys.excepthook = _one_line_excepthook(sys.excepthook)
    argparse.ArgumentParser.error = _one_line_usage_error
