"""fairseq's Transformer decoder whose layers attend with a kernel bias instead of the future mask."""

from contextlib import ExitStack, contextmanager
from functools import partial
from typing import Dict, List, Optional

from fairseq.logging import metrics
from fairseq.models.transformer import TransformerDecoder
from fairseq.modules import transformer_layer
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase
from fairseq.utils import safe_getattr
import torch
from torch import nn

from kerple_core.attention.attend import asked_backend
from kerple_core.attention.blocks import CPU_BLOCK_SCORES
from kerple_core.attention.distance_bias import DistanceBias
from kerple_core.attention.rotary import RotaryEmbedding
from kerple_core.attention.self_attention import AttentionSetup, BiasedSelfAttention
from kerple_fairseq.errors import KernelConfigError
from kerple_core.kernels import BiasKernel, build_kernel
from kerple_core.layer_biases import LAYER_BIASES, build_layer_bias
from kerple_core.visibility import VISIBILITY_RULES, Visibility, build_visibility_rule
from kerple_fairseq.models.composition import layer_methods, layer_rotary
from kerple_fairseq.models.config import DEFAULT_BLOCK_SIZE
from kerple_fairseq.models.position_plan import LayerPositions, layer_plan

# what max_positions() reports when nothing in the model limits the length
UNBOUNDED_POSITIONS = 1 << 30


@contextmanager
def replaced(module, name: str, value):
    """``module.name`` is ``value`` within the block. fairseq builds its decoder and layers by
    module-level names; pointing one at the plugin's class for one call reuses the rest unchanged."""
    stock = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, stock)


def attention_setups(args) -> List[AttentionSetup]:
    """Each layer's :class:`AttentionSetup`: the model's for every layer, or with ``--layer-positions``
    one per entry of the plan (a kernel named by several entries is one module, shared)."""
    plan = layer_plan(safe_getattr(args, "layer_positions", ""), args.decoder_layers)
    if not plan:
        return [attention_setup(args)] * args.decoder_layers
    kernels, setups = {}, {}
    for entry in plan:
        if entry not in setups:
            setups[entry] = attention_setup(args, entry, kernels)
    return [setups[entry] for entry in plan]


def _non_negative(args, name: str, default: int, zero_means: str) -> int:
    """The integer option ``name`` (``--name`` with dashes) or ``default``, refused below 0 with what 0 means."""
    value = safe_getattr(args, name, default)
    if value < 0:
        raise KernelConfigError(f"--{name.replace('_', '-')} must be >= 0 (0: {zero_means}), got {value}")
    return value


def attention_setup(args, entry: Optional[LayerPositions] = None, kernels: Optional[Dict[str, BiasKernel]] = None
                    ) -> AttentionSetup:
    """A layer's bias, rotary embedding and attention options, and the builders of its own bias and
    attention methods (the model's options checked before: :mod:`kerple_fairseq.models.composition`): from
    the model's arguments, or with ``entry`` (a plan's) the bias, rotary, window
    and added methods it names (``kernels``: the kernels built so far, by name, shared). A layer bias
    (``--bias-kernel`` naming one of :mod:`kerple_core.layer_biases`) is added to the distance bias
    of its ``distance_kernel``; a visibility rule (one of :mod:`kerple_core.visibility`, chunked
    attention) goes with no kernel."""
    heads = args.decoder_attention_heads
    head_dim = args.decoder_embed_dim // heads
    layer_bias = None
    kernel_name = args.bias_kernel if entry is None else entry.bias
    rules = ()
    if kernel_name in VISIBILITY_RULES:
        rules, kernel_name = (build_visibility_rule(kernel_name, args),), "none"
    if kernel_name in LAYER_BIASES:
        layer_bias = partial(build_layer_bias, kernel_name, heads, args.decoder_embed_dim, args)
        layer_bias()  # options are checked once, before any layer is built
        kernel_name = LAYER_BIASES[kernel_name].distance_kernel
    kernels = {} if kernels is None else kernels
    if kernel_name not in kernels:
        kernels[kernel_name] = build_kernel(kernel_name, heads, args, head_dim=head_dim)
    kernel = kernels[kernel_name]
    rotary = layer_rotary(args, entry)
    window = safe_getattr(args, "attn_window", 0) if entry is None else entry.window
    builders = [partial(method.build, heads, head_dim, args) for method in layer_methods(args, entry)]
    for build in builders:
        build()  # options are checked once, before any layer is built
    block_size = _non_negative(args, "attention_block_size", DEFAULT_BLOCK_SIZE, "no blocks")
    cpu_block_scores = _non_negative(args, "cpu_attention_block_scores", CPU_BLOCK_SCORES,
                                     "blocks of --attention-block-size queries")
    visibility = Visibility(window=window, rules=rules,
                            cache=_non_negative(args, "max_cache_window", 0, "keep every key"))
    return AttentionSetup(
        bias=DistanceBias(kernel, visibility),
        rotary=RotaryEmbedding(head_dim, args, train_length=safe_getattr(args, "tokens_per_sample", 0) or 0)
        if rotary else None,
        block_size=block_size,
        cpu_block_scores=cpu_block_scores,
        backend=attention_backend(args),
        layer_bias=layer_bias,
        methods=builders,
    )


def attention_backend(args) -> str:
    """``--attention-backend``, or explicit with ``--unfused-attention``. A backend asked for that cannot run on
    this machine (the fused kernel without Triton or a CUDA GPU) is refused in one line, before anything is trained
    or written; on a GPU machine, a model moved to the CPU is refused at its first forward."""
    backend = str(safe_getattr(args, "attention_backend", "auto"))
    if safe_getattr(args, "unfused_attention", False):
        if backend not in ("auto", "explicit"):
            raise KernelConfigError(f"--unfused-attention is --attention-backend explicit: it cannot be combined "
                                    f"with --attention-backend {backend}")
        return "explicit"
    asked_backend(backend, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    return backend


class KernelBiasedDecoderLayer(TransformerDecoderLayerBase):
    """fairseq's decoder layer with :class:`BiasedSelfAttention` as its self-attention."""

    def __init__(self, cfg, no_encoder_attn=False, add_bias_kv=False, add_zero_attn=False, *,
                 setup: AttentionSetup):
        if cfg.cross_self_attention or add_bias_kv or add_zero_attn:
            raise KernelConfigError("--cross-self-attention, add_bias_kv and add_zero_attn are not supported "
                                    "by the plugin's biased self-attention")
        self.setup = setup  # a plain attribute, so it can be set before Module.__init__ builds self_attn
        super().__init__(cfg, no_encoder_attn=no_encoder_attn)

    def build_self_attention(self, embed_dim, cfg, add_bias_kv=False, add_zero_attn=False):
        return BiasedSelfAttention(embed_dim, cfg.decoder.attention_heads, self.setup,
                                   dropout=cfg.attention_dropout, q_noise=self.quant_noise,
                                   qn_block_size=self.quant_noise_block_size)


class KernelBiasedDecoder(TransformerDecoder):
    """A :class:`TransformerDecoder` whose layers attend with the kernel's causal bias.

    The kernel (``args.bias_kernel``) and its parameters live once, in
    ``self.attention_bias`` (state-dict keys ``decoder.attention_bias.kernel.*``); every
    layer's :class:`BiasedSelfAttention` reads it through the shared :class:`AttentionSetup`
    and lays out its own causal bias, so fairseq's future mask is never built.
    ``args.rotary_embeddings`` rotates queries and keys by position in every layer. Layers are
    built by fairseq's ``build_decoder_layer``, so activation checkpointing and FSDP wrap them
    as they wrap stock layers.
    """

    def __init__(self, args, dictionary, embed_tokens, no_encoder_attn=False, output_projection=None):
        # fairseq builds the layers inside TransformerDecoder.__init__, through build_decoder_layer, in order
        self.layer_setups = attention_setups(args)
        self.setup = self.layer_setups[0]
        self._setups_to_build = iter(self.layer_setups)
        super().__init__(args, dictionary, embed_tokens, no_encoder_attn=no_encoder_attn,
                         output_projection=output_projection)
        del self._setups_to_build
        biases = list({id(s.bias): s.bias for s in self.layer_setups}.values())
        if len(biases) == 1:
            self.attention_bias = biases[0]
        else:  # a per-layer plan: each of its biases (a kernel named twice is one module, under both)
            self.attention_biases = nn.ModuleList(biases)

    @property
    def biases(self) -> List[DistanceBias]:
        """Every distinct bias of the layers."""
        return [self.attention_bias] if hasattr(self, "attention_bias") else list(self.attention_biases)

    def build_decoder_layer(self, args, no_encoder_attn=False):
        layer = partial(KernelBiasedDecoderLayer, setup=next(self._setups_to_build))
        with replaced(transformer_layer, "TransformerDecoderLayerBase", layer):
            return super().build_decoder_layer(args, no_encoder_attn=no_encoder_attn)

    def extract_features(self, prev_output_tokens, encoder_out=None, incremental_state=None,
                         full_context_alignment=False, alignment_layer=None, alignment_heads=None):
        if self.training:
            self.log_kernel_parameters()
        with ExitStack() as scopes:
            for bias in self.biases:
                scopes.enter_context(bias.forward_scope())
            return super().extract_features(
                prev_output_tokens,
                encoder_out=encoder_out,
                incremental_state=incremental_state,
                full_context_alignment=full_context_alignment,
                alignment_layer=alignment_layer,
                alignment_heads=alignment_heads,
            )

    def log_kernel_parameters(self) -> None:
        """Each head's learnable kernel parameters as training metrics (``kernel/r1/h1``, ...):
        fairseq averages them over the log interval and writes them to the log and TensorBoard."""
        kernels = list({id(bias.kernel): bias.kernel for bias in self.biases}.values())
        for kernel in kernels:
            values = getattr(kernel, "values", None)
            if values is None:
                continue
            prefix = f"kernel/{kernel.name}." if len(kernels) > 1 else "kernel/"
            for name, per_head in values().items():
                per_head = per_head.detach().float()  # tensors: read only when fairseq logs, no sync per step
                for head in range(per_head.numel()):
                    metrics.log_scalar(f"{prefix}{name}/h{head + 1}", per_head[head], priority=1000, round=4)

    def buffered_future_mask(self, tensor):
        """None: each layer's attention lays out the causal mask and the kernel's bias itself, block
        by block (it knows the positions of its queries and keys, which fairseq does not pass
        during incremental decoding)."""
        return None

    def max_positions(self):
        """Token positional embeddings bound the length; a bias kernel does not."""
        if self.embed_positions is None:
            return UNBOUNDED_POSITIONS
        return super().max_positions()
