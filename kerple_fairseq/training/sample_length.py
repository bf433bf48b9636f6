"""``--tokens-per-sample`` checked when fairseq's ``language_modeling`` task is set up.

fairseq takes any integer: 0 ended fairseq-train, fairseq-hydra-train and fairseq-eval-lm in a
``ZeroDivisionError`` from ``TokenBlockDataset``'s compiled code, a negative value in NumPy's
"negative dimensions", each a traceback naming no option. The task is set up before it reads any
data (and before a run saves anything), so the check there leaves nothing behind.
"""

from fairseq.tasks.language_modeling import LanguageModelingTask

from kerple_fairseq.errors import UsageError


def check_tokens_per_sample(tokens_per_sample) -> None:
    if tokens_per_sample is not None and int(tokens_per_sample) < 1:
        raise UsageError(f"--tokens-per-sample must be >= 1 (the tokens of one sample: the training length, and the "
                         f"block fairseq-eval-lm scores), got {tokens_per_sample}")


def _checking_the_sample_length(stock):
    def __init__(self, args, *rest, **kwargs):
        check_tokens_per_sample(getattr(args, "tokens_per_sample", None))
        stock(self, args, *rest, **kwargs)

    __init__.kerple_fairseq = True
    return __init__


def install_sample_length_check() -> None:
    if not getattr(LanguageModelingTask.__init__, "kerple_fairseq", False):
        LanguageModelingTask.__init__ = _checking_the_sample_length(LanguageModelingTask.__init__)
