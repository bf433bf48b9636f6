"""fairseq's Transformer decoder with a kernel bias in place of the future mask."""

from fairseq.logging import metrics
from fairseq.models.transformer import TransformerDecoder
from fairseq.utils import safe_getattr

from kerple_fairseq.errors import KernelConfigError
from kerple_fairseq.kernels import build_kernel
from kerple_fairseq.models.attention_bias import AttentionBias
from kerple_fairseq.models.config import DEFAULT_BLOCK_SIZE
from kerple_fairseq.models.biased_attention import KernelBiasedSelfAttention
from kerple_fairseq.models.fused_kernel_gradient import FusedKernelGradient
from kerple_fairseq.models.rotary import RotaryEmbedding

# what max_positions() reports when nothing in the model limits the length
UNBOUNDED_POSITIONS = 1 << 30
# smallest block of queries with a window: smaller blocks cost more in per-block overhead than they save
MIN_WINDOW_BLOCK = 64


class KernelBiasedDecoder(TransformerDecoder):
    """A :class:`TransformerDecoder` whose ``buffered_future_mask`` is causal mask plus kernel bias.

    The kernel (``args.bias_kernel``) and its parameters live once, in
    ``self.attention_bias``, with the optional window ``args.attn_window``;
    every layer's self-attention reads the same bias (and weight, for weight
    kernels), built once per forward pass. ``args.rotary_embeddings`` rotates
    queries and keys by position in every layer.
    """

    def __init__(self, args, dictionary, embed_tokens, no_encoder_attn=False, output_projection=None):
        super().__init__(args, dictionary, embed_tokens, no_encoder_attn=no_encoder_attn,
                         output_projection=output_projection)
        kernel = build_kernel(args.bias_kernel, args.decoder_attention_heads, args)
        self.attention_bias = AttentionBias(kernel, window=safe_getattr(args, "attn_window", 0))
        self.block_size = safe_getattr(args, "attention_block_size", DEFAULT_BLOCK_SIZE)
        if self.block_size < 0:
            raise KernelConfigError(f"--attention-block-size must be >= 0 (0: no blocks), got {self.block_size}")
        head_dim = args.decoder_embed_dim // args.decoder_attention_heads
        rotary = RotaryEmbedding(head_dim) if safe_getattr(args, "rotary_embeddings", False) else None
        max_cache_window = safe_getattr(args, "max_cache_window", 0)
        if max_cache_window < 0:
            raise KernelConfigError(f"--max-cache-window must be >= 0 (0: keep every key), got {max_cache_window}")
        kernel_gradient = FusedKernelGradient(self.attention_bias) if kernel.per_head_parameters else None
        for layer in self.layers:
            stock = layer.self_attn
            layer.self_attn = KernelBiasedSelfAttention(
                stock.embed_dim,
                stock.num_heads,
                bias_source=self.attention_bias.forward,
                weight_source=self.attention_bias.weight if kernel.has_weight else None,
                rotary=rotary,
                max_cache_window=max_cache_window,
                fused=not safe_getattr(args, "unfused_attention", False),
                kernel_gradient=kernel_gradient,
                dropout=args.attention_dropout,
                q_noise=args.quant_noise_pq,
                qn_block_size=args.quant_noise_pq_block_size,
            )

    def extract_features(self, prev_output_tokens, encoder_out=None, incremental_state=None,
                         full_context_alignment=False, alignment_layer=None, alignment_heads=None):
        if self.training:
            self.log_kernel_parameters()
        with self.attention_bias.forward_scope():
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
        values = getattr(self.attention_bias.kernel, "values", None)
        if values is None:
            return
        for name, per_head in values().items():
            per_head = per_head.detach().float()  # tensors: read only when fairseq logs, no sync per step
            for head in range(per_head.numel()):
                metrics.log_scalar(f"kernel/{name}/h{head + 1}", per_head[head], priority=1000, round=4)

    def buffered_future_mask(self, tensor):
        """The ``[heads, T, T]`` causal mask plus bias, or, for a sequence longer than one
        attention block, a :class:`BlockedBias` that lays it out block by block."""
        length = tensor.size(0)
        block = self.attention_block_size()
        if 0 < block < length:
            return self.attention_bias.blocks(length, block)
        return self.attention_bias(length, length, tensor.dtype, tensor.device)

    def attention_block_size(self) -> int:
        """Queries per attention block (0: no blocks): ``--attention-block-size``, or with a
        window ``w`` at most ``max(w, MIN_WINDOW_BLOCK)``, so keys outside the window are skipped."""
        block = self.block_size
        window = self.attention_bias.window
        if block > 0 and window > 0:
            block = min(block, max(window, MIN_WINDOW_BLOCK))
        return block

    def max_positions(self):
        """Token positional embeddings bound the length; a bias kernel does not."""
        if self.embed_positions is None:
            return UNBOUNDED_POSITIONS
        return super().max_positions()
