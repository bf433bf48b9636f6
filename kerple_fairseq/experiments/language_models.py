"""Language models of a given size: their fairseq flags, and building one in-process exactly as
fairseq's command line would (the plugin's architectures and stock ``transformer_lm`` alike)."""

import argparse
from typing import List, Optional, Sequence

from fairseq import options
from fairseq.data import Dictionary
from fairseq.models import ARCH_MODEL_REGISTRY
from fairseq.models.transformer_lm import base_lm_architecture


def model_size_flags(layers: int, width: int, heads: int, ffn: Optional[int] = None,
                     dropout: Optional[float] = None) -> List[str]:
    """fairseq flags of a decoder of ``layers`` layers, ``width`` wide, with a feed-forward layer
    ``ffn`` wide (twice the width unless given) and ``heads`` attention heads; ``dropout`` unless
    None (then the architecture's default)."""
    flags = ["--decoder-layers", str(layers), "--decoder-embed-dim", str(width),
             "--decoder-ffn-embed-dim", str(ffn or 2 * width), "--decoder-attention-heads", str(heads)]
    return flags + ([] if dropout is None else ["--dropout", str(dropout)])


class DictionaryTask:
    """The two attributes a language model's ``build_model`` reads from a task: a dictionary,
    here of ``vocab_size`` symbols besides fairseq's four special ones."""

    def __init__(self, vocab_size: int):
        self.source_dictionary = self.target_dictionary = Dictionary()
        for i in range(vocab_size):
            self.source_dictionary.add_symbol(f"w{i}")


def parse_model_flags(flags: Sequence[str]) -> argparse.Namespace:
    """fairseq-train's options for a language model with ``flags`` (``--arch`` among them), with the
    architecture's defaults filled in."""
    args = options.parse_args_and_arch(
        options.get_training_parser(), ["unused-data-dir", "--task", "language_modeling", *flags])
    if args.arch == "transformer_lm":
        # the stock model keeps its defaults in a dataclass, and the architecture named after it
        # applies none of them to options parsed from a command line
        base_lm_architecture(args)
    return args


def build_model(args: argparse.Namespace, task):
    """The model class ``args.arch`` is registered under (the plugin's or stock ``transformer_lm``) builds it."""
    return ARCH_MODEL_REGISTRY[args.arch].build_model(args, task)


def build_language_model(flags: Sequence[str], vocab_size: int):
    """A language model over ``vocab_size`` words, built from fairseq flags (``--arch`` among them)."""
    return build_model(parse_model_flags(flags), DictionaryTask(vocab_size))
