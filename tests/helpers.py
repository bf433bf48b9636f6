"""Building tiny plugin models in-process, as fairseq's command line would."""

import argparse

from fairseq import options
from fairseq.data import Dictionary

import kerple_fairseq  # noqa: F401  (registers the plugin)
from kerple_fairseq.models.transformer_lm_kerple import KernelBiasedLanguageModel

VOCAB = 50


class TinyTask:
    """The two attributes TransformerLanguageModel.build_model reads from a task."""

    def __init__(self, vocab_size: int = VOCAB):
        self.source_dictionary = self.target_dictionary = Dictionary()
        for i in range(vocab_size):
            self.source_dictionary.add_symbol(f"w{i}")


def parse_model_args(arch: str, *flags: str) -> argparse.Namespace:
    parser = options.get_training_parser()
    return options.parse_args_and_arch(
        parser, ["unused-data-dir", "--task", "language_modeling", "--arch", arch, *flags]
    )


TINY = ["--decoder-layers", "2", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
        "--decoder-attention-heads", "4", "--dropout", "0.0"]


def tiny_model(kernel: str = "kerple_log", *flags: str, arch: str = "transformer_lm_kerple", task=None):
    args = parse_model_args(arch, *TINY, "--bias-kernel", kernel, *flags)
    return KernelBiasedLanguageModel.build_model(args, task or TinyTask())
