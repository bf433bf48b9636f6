"""The sizes of samples and batches, checked where fairseq first uses them.

fairseq takes any integer for ``--tokens-per-sample`` and ``--max-tokens``: a sample length below 1
ended fairseq-train, fairseq-hydra-train and fairseq-eval-lm in a ``ZeroDivisionError`` from
``TokenBlockDataset``'s compiled code (NumPy's "negative dimensions" when negative), and a batch of
fewer than 1 token, or fewer than the shortest sample's (a ``--max-tokens`` below ``--tokens-per-sample``),
in an ``IndexError`` from ``batch_by_size`` or fairseq's "The dataset is empty", each under a traceback.
The language_modeling task is set up, and batches are made, before a run saves anything, so each is
refused there with nothing left behind; "The dataset is empty" itself (a ``--max-tokens`` that skips
all but a few short samples) is reported in one line that names the options.
"""

import os
from typing import Optional

import numpy
from fairseq.tasks.fairseq_task import FairseqTask
from fairseq.tasks.language_modeling import LanguageModelingTask

from kerple_fairseq.errors import UsageError, raising_file

#: the start of fairseq's message when a split gave no batch (``fairseq/data/iterators.py``)
NO_BATCHES = "The dataset is empty"


def check_tokens_per_sample(tokens_per_sample) -> None:
    if tokens_per_sample is not None and int(tokens_per_sample) < 1:
        raise UsageError(f"--tokens-per-sample must be >= 1 (the tokens of one sample: the training length, and the "
                         f"block fairseq-eval-lm scores), got {tokens_per_sample}")


def check_max_tokens(max_tokens, dataset) -> None:
    """``max_tokens`` (a batch's tokens) must be at least 1 and hold at least the shortest sample of
    ``dataset``, else fairseq makes no batch at all."""
    if max_tokens is None:
        return
    if int(max_tokens) < 1:
        raise UsageError(f"--max-tokens (and --max-tokens-valid) must be >= 1 (the tokens of one batch; or leave it "
                         f"out and give --batch-size), got {max_tokens}")
    sizes = numpy.asarray(getattr(dataset, "sizes", None) if dataset is not None else None)
    if sizes.ndim == 1 and sizes.size and int(sizes.min()) > int(max_tokens):
        raise UsageError(f"--max-tokens {max_tokens} is below the shortest sample ({int(sizes.min())} tokens), so no "
                         f"batch can be made: give --max-tokens (and --max-tokens-valid) at least --tokens-per-sample")


def no_batches_report(error: BaseException) -> Optional[str]:
    """What a split that gave no batch is told, if ``error`` is fairseq's error for it: fairseq skips
    every sample longer than ``--max-tokens`` and drops a last batch short of
    ``--required-batch-size-multiple``, which can leave none."""
    if type(error) is not Exception or not str(error).startswith(NO_BATCHES):
        return None
    if not raising_file(error).endswith(os.path.join("fairseq", "data", "iterators.py")):
        return None
    return ("no batch could be made: fairseq skips every sample longer than --max-tokens (and a last batch short of "
            "--required-batch-size-multiple), which left none; give --max-tokens at least --tokens-per-sample")


def _checking_the_sample_length(stock):
    def __init__(self, args, *rest, **kwargs):
        check_tokens_per_sample(getattr(args, "tokens_per_sample", None))
        stock(self, args, *rest, **kwargs)

    __init__.kerple_fairseq = True
    return __init__


def _checking_the_batch_size(stock):
    def get_batch_iterator(self, dataset, max_tokens=None, *rest, **kwargs):
        check_max_tokens(max_tokens, dataset)
        return stock(self, dataset, max_tokens, *rest, **kwargs)

    get_batch_iterator.kerple_fairseq = True
    return get_batch_iterator


def install_size_checks() -> None:
    if not getattr(LanguageModelingTask.__init__, "kerple_fairseq", False):
        LanguageModelingTask.__init__ = _checking_the_sample_length(LanguageModelingTask.__init__)
    if not getattr(FairseqTask.get_batch_iterator, "kerple_fairseq", False):
        FairseqTask.get_batch_iterator = _checking_the_batch_size(FairseqTask.get_batch_iterator)
