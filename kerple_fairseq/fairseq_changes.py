"""Every change the plugin makes to fairseq and to the process (how its commands end, its logging), made
once when fairseq loads the plugin for a run (``fairseq-train --user-dir kerple_fairseq``,
``fairseq-hydra-train``, ``fairseq-eval-lm``, ``fairseq-interactive``/``fairseq-generate``, the hub's
``user_dir=``, the plugin's own commands), which imports :mod:`kerple_fairseq`.

:data:`CHANGES` lists them, each with why it exists, in the order :func:`apply_all` makes them;
:data:`SWAPS_DURING_BUILD` lists the two names of fairseq's that point at the plugin's classes while
fairseq builds one of its models, and at fairseq's own again after. Apart from registering the plugin's
model and architectures in fairseq's registries (fairseq's own way for a plugin), no module changes
fairseq, ``argparse``, ``sys.excepthook``, logging or the warnings filters when it is imported: each
offers the function that makes its change, and only :func:`apply_all` calls it. The core beside the
plugin (:mod:`kerple_core`: kernels, layer biases, attention) makes no change at all, on import or in
use (FlexAttention's higher limit of compiles holds only during its own calls). The recognisers of
errors reported in one line, and the hints added to command-line errors, live with what they know (a
checkpoint file, a training run's processes, the model's architectures) and are registered with
:mod:`kerple_fairseq.errors` in this list too, so that :mod:`kerple_fairseq.errors` imports nothing from
the package; their order is their precedence (a refused checkpoint before a lost process, when one
error is both).
"""

import types
from typing import Callable, NamedTuple

import numpy

from kerple_core.quiet import silence_library_notices
from kerple_fairseq.errors import (fairseq_option_check_report, install_one_line_errors, register_one_line_report,
                                   register_usage_hint, report_hydra_jobs_in_one_line)
from kerple_fairseq.evaluation.checkpoint_file import (allow_checkpoint_globals, install_checkpoint_reading_errors,
                                                       missing_checkpoint_report, refused_checkpoint_report)
from kerple_fairseq.evaluation.loading import missing_data_report
from kerple_fairseq.models.transformer_lm_kerple import task_hint
from kerple_fairseq.tasks.retrieval import install_answer_scoring
from kerple_fairseq.training.adaptive_loss import install_float32_adaptive_loss
from kerple_fairseq.training.batch_prefetch import install_prefetch_stopped_at_exit
from kerple_fairseq.training.distributed import install_distributed, lost_peer_report
from kerple_fairseq.training.resume import install_resume
from kerple_fairseq.training.sizes import install_size_checks, no_batches_report
from kerple_fairseq.training.save_dir import install_save_dir_made_on_save

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


def report_refused_checkpoints_in_one_line() -> None:
    register_one_line_report(refused_checkpoint_report)


def report_missing_checkpoints_in_one_line() -> None:
    register_one_line_report(missing_checkpoint_report)


def report_missing_data_in_one_line() -> None:
    register_one_line_report(missing_data_report)


def report_lost_processes_in_one_line() -> None:
    register_one_line_report(lost_peer_report)


def report_failed_option_checks_in_one_line() -> None:
    register_one_line_report(fairseq_option_check_report)


def report_empty_batches_in_one_line() -> None:
    register_one_line_report(no_batches_report)


def hint_the_missing_task() -> None:
    register_usage_hint(task_hint)


class Change(NamedTuple):
    make: Callable[[], None]  # makes the change (again: nothing more changes)
    why: str


CHANGES = (
    Change(silence_library_notices,
           "fairseq 0.12 drives Hydra through APIs that Hydra 1.1+ reports as deprecated (five warnings on every "
           "configuration), and torch reports fairseq's torch.jit.script as deprecated: neither concerns language "
           "modelling nor anything a user can change, and they bury the run's own lines (each silenced by its "
           "exact text; Hydra's and fairseq's text-to-speech loggers kept to warnings)"),
    Change(numpy2_compat,
           "fairseq 0.12 names np.compat.long (--sample-break-mode eos, translation's bucketing), which NumPy 2 "
           "removed, and its TokenBlockDataset counts on NumPy 1 widening unsigned block indices (on NumPy 2 a "
           "one-token block's past target wrapped around)"),
    Change(install_float32_adaptive_loss,
           "fairseq sums adaptive_loss's per-token losses in the model's dtype: in fp16 the recipe's batches "
           "overflow it and every logged loss is inf"),
    Change(install_one_line_errors,
           "a traceback, or argparse's whole usage listing, buries the line that says what to change: usage "
           "errors and the plugin's errors end in that one line (ArgumentParser.error, sys.excepthook)"),
    Change(report_refused_checkpoints_in_one_line,
           "fairseq's own loads (--restore-file, checkpoint_last.pt) refuse a checkpoint that asks for code "
           "with a pickle traceback: one line says why nothing was read and what to give instead"),
    Change(install_checkpoint_reading_errors,
           "fairseq's own reads of a checkpoint (fairseq-eval-lm, fairseq-interactive, fairseq-generate, "
           "--restore-file, the hub interface) end a truncated or foreign file in torch's traceback, which names "
           "no file: one line names the file and says what to give instead; and a plugin checkpoint saved before "
           "an option that changed a behaviour (--ssmax-scope, --rerope-query-scale, --attn-temperature-layers) "
           "existed gets the value that keeps the behaviour it was trained with, where fairseq would give it the "
           "new default"),
    Change(report_missing_checkpoints_in_one_line,
           "a --path that does not exist ends fairseq's tools in a traceback (OSError: Model file not found)"),
    Change(report_missing_data_in_one_line,
           "a folder that is not a data-bin, a split it lacks, or a checkpoint of another dictionary end "
           "fairseq's tools in tracebacks (FileNotFoundError of dict.txt, 'Dataset not found', load_state_dict's "
           "size mismatch): one line says which and what to give"),
    Change(report_failed_option_checks_in_one_line,
           "fairseq's commands check some options with assert (fairseq-train without --max-tokens or "
           "--batch-size): the AssertionError's traceback hides its message, which says what to add"),
    Change(report_hydra_jobs_in_one_line,
           "Hydra catches a job's errors and prints them with its traceback, so fairseq-hydra-train never reached "
           "the one-line reports: a failed job whose error has one ends in that line"),
    Change(install_size_checks,
           "fairseq takes any --tokens-per-sample and --max-tokens: below 1, or a --max-tokens below every "
           "sample's length, they ended fairseq-train, fairseq-hydra-train and fairseq-eval-lm in tracebacks from "
           "TokenBlockDataset and batch_by_size that name no option; each is refused in one line before any data is "
           "read (the sample length) or batched (the batch's)"),
    Change(report_empty_batches_in_one_line,
           "a --max-tokens that skips all but a few short samples leaves no batch, and fairseq's 'The dataset is "
           "empty' came under a traceback: one line says which options to change"),
    Change(install_save_dir_made_on_save,
           "fairseq-train makes --save-dir before it reads the data, so a refused run left an empty folder "
           "behind: the folder is made when the first checkpoint is saved"),
    Change(report_lost_processes_in_one_line,
           "when a process of a training run dies, the others' collectives fail with tracebacks that hide "
           "it: one line says a process was lost and that the same command resumes"),
    Change(hint_the_missing_task,
           "without --task, fairseq-train's default task (translation) refuses the plugin architectures' "
           "options as unrecognized arguments: the error says to add --task language_modeling"),
    Change(allow_checkpoint_globals,
           "fairseq's own weights-only loads (fairseq-eval-lm, --restore-file, the hub interface) refused "
           "older checkpoints, whose args is an argparse.Namespace and whose metrics hold NumPy scalars"),
    Change(install_distributed,
           "fairseq 0.12 ignored torchrun's variables on CPU, asked for NCCL without GPUs, gave DDP a GPU for "
           "a model on CPU, and let a collective wait 30 minutes for a dead process (training/distributed.py)"),
    Change(install_resume,
           "fairseq 0.12 left a truncated checkpoint_last.pt when killed during its copy, could not send the "
           "checkpoint to processes that read it weights-only, and could not resume on another number of "
           "processes (training/resume.py)"),
    Change(install_prefetch_stopped_at_exit,
           "fairseq's daemon thread that collates the next batches was still in torch when a run stopped "
           "mid-epoch (--max-update) exited, and Python 3.11's end of such a thread aborted the process "
           "(SIGABRT) after it had trained and saved: it now ends at its next batch before the interpreter "
           "exits"),
    Change(install_answer_scoring,
           "fairseq-eval-lm's SequenceScorer scores a target's first n positions, n its tokens that are not "
           "padding: the retrieval task's answers, which come after padding, were scored at the wrong positions "
           "(tasks/retrieval.py); every other batch is scored as before"),
)


class Swap(NamedTuple):
    module: str  # fairseq's module
    name: str  # the name in it that points at the plugin's class while a plugin model is built
    why: str


SWAPS_DURING_BUILD = (
    Swap("fairseq.models.transformer_lm", "TransformerDecoder",
         "TransformerLanguageModel.build_model builds the embeddings (plain, adaptive or character) and then "
         "the decoder by this name: pointing it at KernelBiasedDecoder for that one call reuses the rest "
         "(models/transformer_lm_kerple.py)"),
    Swap("fairseq.modules.transformer_layer", "TransformerDecoderLayerBase",
         "TransformerDecoder.build_decoder_layer wraps each layer (activation checkpointing, FSDP) after "
         "building it by this name: pointing it at the layer that attends with the position methods for each "
         "call keeps the wrapping (models/decoder.py)"),
)


def apply_all() -> None:
    """Make every change of :data:`CHANGES`, in order (again: nothing more changes)."""
    for change in CHANGES:
        change.make()
