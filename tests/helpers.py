"""Building tiny plugin models in-process, as fairseq's command line would."""

import argparse

import torch

from kerple_fairseq.experiments.language_models import DictionaryTask, build_model, model_size_flags, parse_model_flags

VOCAB = 50
TINY = model_size_flags(layers=2, width=32, heads=4, dropout=0.0)


class TinyTask(DictionaryTask):
    """A task whose dictionary has ``vocab_size`` words (default :data:`VOCAB`)."""

    def __init__(self, vocab_size: int = VOCAB):
        super().__init__(vocab_size)


def parse_model_args(arch: str, *flags: str) -> argparse.Namespace:
    return parse_model_flags(["--arch", arch, *flags])


def tiny_model(kernel: str = "kerple_log", *flags: str, arch: str = "transformer_lm_kerple", task=None):
    return build_model(parse_model_args(arch, *TINY, "--bias-kernel", kernel, *flags), task or TinyTask())


def random_tokens(batch=3, length=24, seed=0):
    """Token ids of :class:`TinyTask`'s dictionary past its 4 special symbols."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, VOCAB + 4, (batch, length), generator=g)
