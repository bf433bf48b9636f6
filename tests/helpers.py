"""Building tiny plugin models in-process, as fairseq's command line would."""

import argparse
import ast

import torch

from kerple_fairseq.experiments.language_models import DictionaryTask, build_model, model_size_flags, parse_model_flags
from kerple_fairseq.experiments.position_encodings import POSITION_ENCODINGS, position_encoding
from kerple_fairseq.models.position_methods import bias_names

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


#: every method FlexAttention serves, by name: (``--bias-kernel``, more flags): each distance kernel
#: and layer bias, and the rotary family (which acts on queries and keys) over the causal mask
FLEX_METHODS = {name: (name, ["--attn-window", "9"] if name == "window" else []) for name in
                bias_names()}
FLEX_METHODS.update({
    "rotary": ("none", ["--rotary-embeddings"]),
    "xpos": ("none", ["--rotary-embeddings", "--rotary-xpos"]),
    "p-rope": ("none", ["--rotary-embeddings", "--rotary-fraction", "0.5"]),
    "rotary-dynamic-ntk": ("none", ["--rotary-embeddings", "--rotary-scaling", "dynamic-ntk",
                                    "--dynamic-ntk-step", "8", "--tokens-per-sample", "16"]),
    "fire": ("fire", ["--fire-threshold", "4"]),
    "chunked": ("chunked", ["--attn-chunk-size", "8"]),
    "ssmax": ("none", ["--rotary-embeddings", "--ssmax"]),
    "bam": ("bam", ["--bam-loc-trainable"]),  # its location learned, so that its gradient is compared too
    "bam-ssmax": ("bam", ["--ssmax"]),  # the bias scaled row by row
    "kerple_log-temperature": ("kerple_log", ["--attn-temperature-tuning", "--attn-temperature-floor-scale", "8"]),
})

#: methods whose term takes gradients (a layer's own term, a bias SSMax scales row by row), which FlexAttention
#: serves on CUDA only without gradients (:func:`~kerple_core.attention.backends.flex.serves`): in training
#: another backend serves them
NO_FLEX_BACKWARD = {"fox", "fox_bias_only", "fire", "bam-ssmax"}
#: the tiny models with heads of 16 dimensions, the fewest FlexAttention's CUDA kernels take
HEADS_OF_16 = ("--decoder-attention-heads", "2")


def moved(model):
    """``model`` in evaluation mode, every parameter moved away from its initial value."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def flex_method_model(name: str, *flags: str):
    """:data:`FLEX_METHODS` ``name``'s tiny model in evaluation mode, every parameter moved away from
    its initial value (seed 0)."""
    kernel, method_flags = FLEX_METHODS[name]
    torch.manual_seed(0)
    return moved(tiny_model(kernel, *method_flags, *flags))


def as_model_flags(eval_flags):
    """kerple-eval-lm's options of an encoding as model options: ``--model-overrides "{'a_b': v}"`` as ``--a-b v``
    (a switch ``{'a_b': True}`` as ``--a-b``)."""
    flags, rest = [], list(eval_flags)
    while rest:
        flag = rest.pop(0)
        if flag == "--model-overrides":
            for key, value in ast.literal_eval(rest.pop(0)).items():
                if value is True:
                    flags.append(f"--{key.replace('_', '-')}")
                elif value is not False:
                    flags += [f"--{key.replace('_', '-')}", str(value)]
        else:
            flags.append(flag)
    return flags


def every_encoding():
    """fairseq flags by name: the comparison's position encodings (an evaluation-time method such as
    ReRoPE set in the model), then every other kernel and layer bias on ``transformer_lm_kerple`` (each
    model once), and learned positions."""
    flags = {}
    for name in [*POSITION_ENCODINGS, *bias_names()]:
        encoding = position_encoding(name)
        model_flags = encoding.model_flags() + as_model_flags(encoding.eval_flags) + \
            (["--attn-window", "16"] if name == "window" else [])
        if model_flags not in flags.values():
            flags[name] = model_flags
    flags["learned_pos"] = ["--arch", "transformer_lm_learned_pos"]
    return flags


def encoding_model(flags, *more: str):
    """The tiny model of an encoding's fairseq ``flags`` (:func:`every_encoding`), ``more`` flags after
    them, in evaluation mode, every parameter moved away from its initial value (seed 0)."""
    torch.manual_seed(0)
    return moved(build_model(parse_model_flags([*flags, *TINY, *more]), TinyTask()))
