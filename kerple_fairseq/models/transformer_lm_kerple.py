"""``transformer_lm`` with pluggable attention-bias kernels, and its architectures."""

from fairseq.models import register_model, register_model_architecture
from fairseq.models import transformer_lm
from fairseq.models.transformer_lm import (
    TransformerLanguageModel,
    base_lm_architecture,
    transformer_lm_baevski_wiki103,
)
from fairseq.utils import safe_getattr

from kerple_fairseq.errors import KernelConfigError
from kerple_fairseq.kernels import KERNELS
from kerple_fairseq.models.config import KernelBiasedLMConfig
from kerple_fairseq.models.decoder import KernelBiasedDecoder, replaced

# the model; its architectures below are what --arch names
MODEL_NAME = "kerple_lm"


def check_positions(args) -> None:
    """One source of position: a distance-encoding kernel, or token positions, or rotary."""
    token_positions = not args.no_token_positional_embeddings
    if token_positions and args.rotary_embeddings:
        raise KernelConfigError(
            "--token-positional-embeddings and --rotary-embeddings are two position encodings; "
            "choose one")
    if KERNELS[args.bias_kernel].encodes_position and (token_positions or args.rotary_embeddings):
        which = "rotary embeddings" if args.rotary_embeddings else "token positional embeddings"
        flag = "--rotary-embeddings" if args.rotary_embeddings else \
            "--token-positional-embeddings (or set no_token_positional_embeddings=True)"
        raise KernelConfigError(
            f"--bias-kernel {args.bias_kernel} already encodes position, but {which} are on as "
            f"well; drop {flag}, or use --bias-kernel none (or window) for a positional baseline"
        )


@register_model(MODEL_NAME, dataclass=KernelBiasedLMConfig)
class KernelBiasedLanguageModel(TransformerLanguageModel):
    """A decoder-only Transformer LM whose attention carries a positional bias kernel."""

    @classmethod
    def build_model(cls, args, task):
        kerple_base_architecture(args)
        check_positions(args)
        # TransformerLanguageModel.build_model builds the embeddings (plain, adaptive or
        # character), then the module-level name TransformerDecoder
        with replaced(transformer_lm, "TransformerDecoder", KernelBiasedDecoder):
            return super().build_model(args, task)


def _plugin_defaults(args, default_kernel: str, rotary: bool = False, token_positions: bool = False,
                     learned_positions: bool = False) -> None:
    args.bias_kernel = safe_getattr(args, "bias_kernel", default_kernel)
    args.rotary_embeddings = safe_getattr(args, "rotary_embeddings", rotary)
    args.attn_window = safe_getattr(args, "attn_window", 0)
    args.token_positional_embeddings = safe_getattr(args, "token_positional_embeddings", token_positions)
    args.decoder_learned_pos = safe_getattr(args, "decoder_learned_pos", learned_positions)
    args.no_token_positional_embeddings = safe_getattr(
        args, "no_token_positional_embeddings", False
    ) or not args.token_positional_embeddings


@register_model_architecture(MODEL_NAME, "transformer_lm_kerple")
def kerple_base_architecture(args):
    """fairseq's ``transformer_lm`` sizes, KERPLE-log bias, no token positions."""
    _plugin_defaults(args, "kerple_log")
    base_lm_architecture(args)


@register_model_architecture(MODEL_NAME, "transformer_lm_kerple_wiki103")
def kerple_wiki103_architecture(args):
    """ALiBi's WikiText-103 model (``transformer_lm_wiki103``), KERPLE-log bias."""
    _plugin_defaults(args, "kerple_log")
    transformer_lm_baevski_wiki103(args)


@register_model_architecture(MODEL_NAME, "transformer_lm_alibi")
def alibi_base_architecture(args):
    """fairseq's ``transformer_lm`` sizes, ALiBi bias, no token positions."""
    _plugin_defaults(args, "alibi")
    base_lm_architecture(args)


@register_model_architecture(MODEL_NAME, "transformer_lm_alibi_wiki103")
def alibi_wiki103_architecture(args):
    """ALiBi's WikiText-103 model (``transformer_lm_wiki103``), ALiBi bias."""
    _plugin_defaults(args, "alibi")
    transformer_lm_baevski_wiki103(args)


@register_model_architecture(MODEL_NAME, "transformer_lm_rotary")
def rotary_base_architecture(args):
    """fairseq's ``transformer_lm`` sizes, rotary positions, no bias (``--attn-window W``: super-baseline)."""
    _plugin_defaults(args, "none", rotary=True)
    base_lm_architecture(args)


@register_model_architecture(MODEL_NAME, "transformer_lm_rotary_wiki103")
def rotary_wiki103_architecture(args):
    """ALiBi's WikiText-103 model (``transformer_lm_wiki103``) with rotary positions, no bias."""
    _plugin_defaults(args, "none", rotary=True)
    transformer_lm_baevski_wiki103(args)


@register_model_architecture(MODEL_NAME, "transformer_lm_sinusoidal")
def sinusoidal_base_architecture(args):
    """fairseq's ``transformer_lm`` sizes, sinusoidal token positions, no bias: the sinusoidal
    baseline built exactly as the kernel models are (stock ``--arch transformer_lm`` is not: it keeps
    512-wide embeddings and post-LayerNorm when ``--decoder-embed-dim`` is changed)."""
    _plugin_defaults(args, "none", token_positions=True)
    base_lm_architecture(args)


@register_model_architecture(MODEL_NAME, "transformer_lm_sinusoidal_wiki103")
def sinusoidal_wiki103_architecture(args):
    """ALiBi's WikiText-103 model (``transformer_lm_wiki103``) with sinusoidal token positions, no bias."""
    _plugin_defaults(args, "none", token_positions=True)
    transformer_lm_baevski_wiki103(args)


@register_model_architecture(MODEL_NAME, "transformer_lm_learned_pos")
def learned_pos_base_architecture(args):
    """fairseq's ``transformer_lm`` sizes, learned token positions (one per position up to
    ``--tokens-per-sample``: no extrapolation), no bias."""
    _plugin_defaults(args, "none", token_positions=True, learned_positions=True)
    base_lm_architecture(args)


@register_model_architecture(MODEL_NAME, "transformer_lm_learned_pos_wiki103")
def learned_pos_wiki103_architecture(args):
    """ALiBi's WikiText-103 model (``transformer_lm_wiki103``) with learned token positions, no bias."""
    _plugin_defaults(args, "none", token_positions=True, learned_positions=True)
    transformer_lm_baevski_wiki103(args)
