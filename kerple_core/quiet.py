"""Keep the libraries' notices about themselves out of the plugin's output.

Importing fairseq 0.12 calls ``logging.basicConfig(level=DEBUG)`` (in its wav2vec2 classification
model) and ``basicConfig(level=INFO)`` (in its text-to-speech tasks), which makes every later library
log line appear in a process that had not set up logging itself, such as kerple-eval-lm's. fairseq
0.12 also drives Hydra through APIs that Hydra 1.1+ reports as deprecated (five warnings on every
configuration), logs "Please install tensorboardX" for its text-to-speech task on import, and scripts
modules with ``torch.jit.script``, which torch 2.13 reports as deprecated. None of these concern
language modelling or anything a user can change; each is silenced by its exact text, so other
warnings still show.

Importing the core changes none of this (:func:`imported_quietly`); the plugin silences the notices for
the whole process when fairseq loads it for a run (:mod:`kerple_fairseq.fairseq_changes`).
"""

import contextlib
import logging
import warnings

HYDRA_DEPRECATIONS = (
    r"\s*hydra\.experimental\.\w+\(\) is no longer experimental",
    r"\s*The version_base parameter is not specified",
    r"\s*In '\w+': Usage of deprecated keyword in package header",
    r"\s*'\w+' is validated against ConfigStore schema with the same name",
    r"\s*The strict flag in the compose API is deprecated",
)
TORCH_JIT_DEPRECATION = r"`torch\.jit\.script` is deprecated"
NOISY_LOGGERS = ("fairseq.tasks.text_to_speech", "hydra")


def silence_library_notices() -> None:
    """Filter the warnings above and keep the noisy loggers to warnings and errors (idempotent): for the
    whole process, which the plugin does when fairseq loads it for a run."""
    for message in HYDRA_DEPRECATIONS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    warnings.filterwarnings("ignore", message=TORCH_JIT_DEPRECATION, category=DeprecationWarning)
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


@contextlib.contextmanager
def logging_left_to_the_process():
    """Within it, importing fairseq does not set up the root logger: a process that had not set up
    logging keeps Python's default (warnings and errors only), one that had keeps its own."""
    root = logging.getLogger()
    placeholder = None if root.handlers else logging.NullHandler()
    if placeholder is not None:
        root.addHandler(placeholder)  # basicConfig does nothing while the root logger has a handler
    try:
        yield
    finally:
        if placeholder is not None:
            root.removeHandler(placeholder)


@contextlib.contextmanager
def imported_quietly():
    """Within it, importing fairseq neither prints the notices above nor changes the process: the root
    logger, the warnings filters and the noisy loggers' levels are as they were when it ends."""
    levels = {name: logging.getLogger(name).level for name in NOISY_LOGGERS}
    with warnings.catch_warnings(), logging_left_to_the_process():
        silence_library_notices()
        try:
            yield
        finally:
            for name, level in levels.items():
                logging.getLogger(name).setLevel(level)
