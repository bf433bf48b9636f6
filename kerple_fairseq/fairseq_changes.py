"""Every change the plugin makes to fairseq (and to how its commands end), made once when the plugin
is imported, so that ``fairseq-train --user-dir kerple_fairseq``, ``fairseq-hydra-train``,
``fairseq-eval-lm``, ``fairseq-interactive``/``fairseq-generate`` and the hub interface get them:

- :func:`numpy2_compat`: fairseq 0.12 names ``np.compat.long`` (``--sample-break-mode eos``; translation's
  bucketing), which NumPy 2 removed: those modules see a NumPy that still has it; and
  ``TokenBlockDataset`` keeps its block indices in the smallest unsigned dtype, whose arithmetic NumPy 2
  no longer widens (``e - 2`` of a one-token block wraps around): on NumPy 2 they are kept as int64;
- :func:`~kerple_fairseq.training.adaptive_loss.install_float32_adaptive_loss`: ``adaptive_loss`` sums its
  per-token losses in float32 (in fp16 fairseq's sum overflows to ``inf``);
- :func:`~kerple_fairseq.errors.install_one_line_errors`: usage errors and the plugin's errors end in
  one line, not a traceback (``ArgumentParser.error``, ``sys.excepthook``);
- :func:`~kerple_fairseq.evaluation.checkpoint_file.allow_checkpoint_globals`: fairseq's own
  weights-only checkpoint loads read older checkpoints' ``args`` too;
- :func:`~kerple_fairseq.training.install_training_fixes`: torchrun and gloo on CPU, bounded waits,
  whole checkpoints, resuming on other process counts (``call_main``, ``distributed_init``, DDP,
  ``PathManager``, ``EpochBatchIterator``).
"""

import types

import numpy

#: fairseq's modules that name ``np.compat`` (fairseq 0.12.2 and fairseq-fixed 0.12.3.1)
NUMPY_COMPAT_USERS = ("fairseq.data.token_block_dataset", "fairseq.data.language_pair_dataset")


class _NumPyWithCompat(types.ModuleType):
    """NumPy as seen by a module written for NumPy 1: everything NumPy has, and ``compat.long``
    (NumPy 1's alias of Python's ``int``)."""

    compat = types.SimpleNamespace(long=int)

    def __getattr__(self, name):
        return getattr(numpy, name)


def numpy2_compat() -> None:
    """On NumPy 2, give the modules of :data:`NUMPY_COMPAT_USERS` a view of NumPy with ``compat.long``,
    and ``TokenBlockDataset`` signed block indices; NumPy itself is left as it is. On NumPy 1 nothing
    changes."""
    if hasattr(numpy, "compat"):
        return
    import importlib

    view = _NumPyWithCompat("numpy")
    for name in NUMPY_COMPAT_USERS:
        importlib.import_module(name).np = view
    token_blocks = importlib.import_module("fairseq.data.token_block_dataset").TokenBlockDataset
    token_blocks.__init__ = _signed_block_indices(token_blocks.__init__)


def _signed_block_indices(init):
    """``TokenBlockDataset.__init__``, its block indices then held as int64 (NumPy 1 widened its
    unsigned scalars in ``__getitem__``'s arithmetic; NumPy 2 keeps their dtype)."""
    from fairseq.data import plasma_utils

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        for name in ("_slice_indices", "_block_to_dataset_index"):
            held = getattr(self, name)
            if isinstance(held, plasma_utils.PlasmaArray):
                setattr(self, name, plasma_utils.PlasmaArray(held.array.astype(numpy.int64)))
    return __init__


def apply_all() -> None:
    from kerple_fairseq.errors import install_one_line_errors
    from kerple_fairseq.evaluation.checkpoint_file import allow_checkpoint_globals
    from kerple_fairseq.training import install_training_fixes
    from kerple_fairseq.training.adaptive_loss import install_float32_adaptive_loss

    numpy2_compat()
    install_float32_adaptive_loss()
    install_one_line_errors()
    allow_checkpoint_globals()
    install_training_fixes()
