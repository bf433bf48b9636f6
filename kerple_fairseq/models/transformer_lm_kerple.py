"""``transformer_lm`` with pluggable attention-bias kernels, and its architectures."""

from fairseq.models import ARCH_MODEL_NAME_REGISTRY, register_model, register_model_architecture
from fairseq.models import transformer_lm
from fairseq.models.transformer_lm import (
    TransformerLanguageModel,
    base_lm_architecture,
    transformer_lm_baevski_wiki103,
)
from fairseq.utils import safe_getattr

from kerple_fairseq.errors import KernelConfigError, option_value
from kerple_fairseq.models.composition import check_model
from kerple_fairseq.models.config import KernelBiasedLMConfig
from kerple_fairseq.models.decoder import KernelBiasedDecoder, replaced

# the model; its architectures below are what --arch names
MODEL_NAME = "kerple_lm"


def language_modeling_task_missing(arch: str, task: str) -> str:
    """What to say when the plugin's architecture ``arch`` is given without a language-modelling task."""
    return (f"--arch {arch} is a language model, but the task is {task} (fairseq's default when --task is not "
            "given): add --task language_modeling")


def task_hint(message: str, argv) -> str:
    """A plugin architecture's language-model options refused because no --task was given: say so
    (appended to the command-line error ``message``; registered with
    :func:`kerple_fairseq.errors.register_usage_hint` by :mod:`kerple_fairseq.fairseq_changes`)."""
    if "unrecognized arguments" not in message or option_value(argv, "--task") is not None:
        return ""
    arch = option_value(argv, "--arch", "-a")
    if ARCH_MODEL_NAME_REGISTRY.get(arch) != MODEL_NAME:
        return ""
    return f"; {language_modeling_task_missing(arch, 'translation')}"


def check_task(args) -> None:
    """One line for a plugin architecture under a task without a language model's options, such as
    fairseq-train's default, translation (fairseq would fail later, deep inside its configuration)."""
    task = safe_getattr(args, "task", None)
    if task is not None and not hasattr(args, "tokens_per_sample"):
        raise KernelConfigError(language_modeling_task_missing(args.arch, task))


@register_model(MODEL_NAME, dataclass=KernelBiasedLMConfig)
class KernelBiasedLanguageModel(TransformerLanguageModel):
    """A decoder-only Transformer LM whose attention carries a positional bias kernel."""

    @classmethod
    def build_model(cls, args, task):
        kerple_base_architecture(args)
        check_model(args)
        # TransformerLanguageModel.build_model builds the embeddings (plain, adaptive or
        # character), then the module-level name TransformerDecoder
        with replaced(transformer_lm, "TransformerDecoder", KernelBiasedDecoder):
            return super().build_model(args, task)


def _plugin_defaults(args, default_kernel: str, rotary: bool = False, cope: bool = False,
                     token_positions: bool = False, learned_positions: bool = False) -> None:
    args.bias_kernel = safe_getattr(args, "bias_kernel", default_kernel)
    args.rotary_embeddings = safe_getattr(args, "rotary_embeddings", rotary)
    args.cope = safe_getattr(args, "cope", cope)
    args.attn_window = safe_getattr(args, "attn_window", 0)
    args.token_positional_embeddings = safe_getattr(args, "token_positional_embeddings", token_positions)
    args.decoder_learned_pos = safe_getattr(args, "decoder_learned_pos", learned_positions)
    args.no_token_positional_embeddings = safe_getattr(
        args, "no_token_positional_embeddings", False
    ) or not args.token_positional_embeddings


def register_architectures(name: str, default_kernel: str, encoding: str, **positions):
    """Register ``transformer_lm_<name>`` (fairseq's ``transformer_lm`` sizes) and
    ``transformer_lm_<name>_wiki103`` (ALiBi's WikiText-103 model, ``transformer_lm_wiki103``), both
    with the position ``encoding`` described (``default_kernel`` and ``positions`` for
    :func:`_plugin_defaults`); returns the first's architecture function."""

    def base(args):
        check_task(args)
        _plugin_defaults(args, default_kernel, **positions)
        base_lm_architecture(args)

    def wiki103(args):
        check_task(args)
        _plugin_defaults(args, default_kernel, **positions)
        transformer_lm_baevski_wiki103(args)

    base.__doc__ = f"fairseq's ``transformer_lm`` sizes, {encoding}."
    wiki103.__doc__ = f"ALiBi's WikiText-103 model (``transformer_lm_wiki103``), {encoding}."
    register_model_architecture(MODEL_NAME, f"transformer_lm_{name}")(base)
    register_model_architecture(MODEL_NAME, f"transformer_lm_{name}_wiki103")(wiki103)
    return base


kerple_base_architecture = register_architectures("kerple", "kerple_log", "KERPLE-log bias, no token positions")
register_architectures("alibi", "alibi", "ALiBi bias, no token positions")
register_architectures("rotary", "none", "rotary positions, no bias (``--attn-window W``: the super-baseline)",
                       rotary=True)
register_architectures("cope", "none", "CoPE (contextual positions), no bias", cope=True)
# the positional baselines built exactly as the kernel models are (stock ``--arch transformer_lm`` is
# not: it keeps 512-wide embeddings and post-LayerNorm when ``--decoder-embed-dim`` is changed)
register_architectures("sinusoidal", "none", "sinusoidal token positions, no bias", token_positions=True)
register_architectures("learned_pos", "none", "learned token positions (one per position up to "
                       "``--tokens-per-sample``: no extrapolation), no bias", token_positions=True, learned_positions=True)
