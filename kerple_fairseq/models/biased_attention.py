"""Self-attention that adds a per-head bias (and, for weight kernels, multiplies the logits by a
per-head weight) on every path, incremental decoding included."""

from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from fairseq import utils
from fairseq.modules import MultiheadAttention
from torch import Tensor

from kerple_fairseq.models.attention_bias import BlockedBias
from kerple_fairseq.models.fused_kernel_gradient import FusedKernelGradient
from kerple_fairseq.models.rotary import RotaryEmbedding

# (query_len, key_len, dtype, device) -> [heads, query_len, key_len]
BiasSource = Callable[[int, int, torch.dtype, torch.device], Tensor]


class KernelBiasedSelfAttention(MultiheadAttention):
    """fairseq's self-attention, with masks of shape ``[heads, queries, keys]``.

    ``attn_mask`` may be ``[queries, keys]`` (stock fairseq) or
    ``[heads, queries, keys]``; either is broadcast over the batch, never
    copied per batch element. It may also be a :class:`BlockedBias` (long
    sequences): attention is then computed one block of queries at a time. During incremental decoding fairseq passes no
    mask, so the bias for the new queries against all cached keys comes from
    ``bias_source(query_len, key_len, dtype, device)``. With a ``weight_source``
    (weight kernels), the scaled logits are multiplied by its weight before the
    mask is added, on every path. With ``rotary``, queries and keys are rotated
    by their absolute positions (cached keys keep theirs). The key/value cache
    has fairseq's layout, so beam-search reordering works unchanged. With
    ``max_cache_window = w`` the cache keeps only the last ``w`` keys and values
    (Sandwich App. B) and the new queries attend as under a window of ``w``.
    Where only the attended values are needed (no weights returned, no key
    padding, no weight kernel) and ``fused`` is on, attention runs through
    PyTorch's ``scaled_dot_product_attention`` with the bias as its mask; with a
    ``kernel_gradient`` (learnable per-head kernels), through PyTorch's fused CPU
    kernel with the kernel's gradient from fused forwards, where that applies.

    Parameters and state-dict keys are those of :class:`MultiheadAttention`.
    """

    def __init__(self, embed_dim: int, num_heads: int, bias_source: BiasSource,
                 weight_source: Optional[BiasSource] = None, rotary: Optional[RotaryEmbedding] = None,
                 max_cache_window: int = 0, fused: bool = True,
                 kernel_gradient: Optional[FusedKernelGradient] = None, dropout: float = 0.0,
                 q_noise: float = 0.0, qn_block_size: int = 8):
        super().__init__(embed_dim, num_heads, dropout=dropout, self_attention=True,
                         q_noise=q_noise, qn_block_size=qn_block_size)
        self.bias_source = bias_source
        self.weight_source = weight_source
        self.rotary = rotary
        self.max_cache_window = max_cache_window
        self.fused = fused
        self.kernel_gradient = kernel_gradient

    def forward(
        self,
        query: Tensor,
        key: Optional[Tensor],
        value: Optional[Tensor],
        key_padding_mask: Optional[Tensor] = None,
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
        need_weights: bool = True,
        static_kv: bool = False,
        attn_mask: Optional[Tensor] = None,
        before_softmax: bool = False,
        need_head_weights: bool = False,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        if static_kv:
            raise ValueError("KernelBiasedSelfAttention is self-attention only (static_kv=True given)")
        tgt_len, bsz, embed_dim = query.size()
        heads, head_dim = self.num_heads, self.head_dim

        def split_heads(x: Tensor) -> Tensor:  # [T, B, E] -> [B, H, T, D]
            return x.view(tgt_len, bsz, heads, head_dim).permute(1, 2, 0, 3)

        q = split_heads(self.q_proj(query) * self.scaling)
        k = split_heads(self.k_proj(query))
        v = split_heads(self.v_proj(query))

        saved = self._get_input_buffer(incremental_state) if incremental_state is not None else {}
        seen = int(saved["positions_seen"][0]) if "positions_seen" in saved else 0
        if self.rotary is not None:
            q, k = self.rotary(q, k, offset=seen)

        if incremental_state is not None:
            if "prev_key" in saved:
                k = torch.cat([saved["prev_key"], k], dim=2)
                v = torch.cat([saved["prev_value"], v], dim=2)
            key_padding_mask = MultiheadAttention._append_prev_key_padding_mask(
                key_padding_mask=key_padding_mask,
                prev_key_padding_mask=saved.get("prev_key_padding_mask"),
                batch_size=bsz,
                src_len=k.size(2),
                static_kv=False,
            )
            window = self.max_cache_window
            if window and tgt_len > 1:
                raise ValueError("--max-cache-window decodes one token per step, as fairseq's incremental "
                                 f"decoding does ({tgt_len} given)")
            if window and k.size(2) > window:
                # the new query sees the last `window` keys; older ones are never needed again
                k, v = k[:, :, -window:], v[:, :, -window:]
                if key_padding_mask is not None:
                    key_padding_mask = key_padding_mask[:, -window:]
            saved["prev_key"], saved["prev_value"] = k, v
            saved["prev_key_padding_mask"] = key_padding_mask
            # a [batch] tensor, so fairseq's beam reordering (index_select on dim 0) carries it along
            saved["positions_seen"] = torch.full((bsz,), seen + tgt_len, dtype=torch.long, device=q.device)
            self._set_input_buffer(incremental_state, saved)
            if attn_mask is None:
                attn_mask = self.bias_source(tgt_len, k.size(2), q.dtype, q.device)
        only_values = key_padding_mask is None and not before_softmax and not (need_weights or need_head_weights)
        if isinstance(attn_mask, BlockedBias):
            if only_values:
                attn = self._attend_in_blocks(q, k, v, attn_mask)
                return self.out_proj(attn.permute(2, 0, 1, 3).reshape(tgt_len, bsz, embed_dim)), None
            attn_mask = attn_mask.dense(q.dtype, q.device)
        if only_values and self.can_fuse():
            attn = self._fused(q, k, v, attn_mask, offset=k.size(2) - tgt_len)
            return self.out_proj(attn.permute(2, 0, 1, 3).reshape(tgt_len, bsz, embed_dim)), None
        src_len = k.size(2)

        scores = torch.matmul(q, k.transpose(-1, -2))  # [B, H, T, S]
        if self.weight_source is not None:
            scores = scores * self.weight_source(tgt_len, src_len, q.dtype, q.device)
        if attn_mask is not None:
            scores += attn_mask.to(scores.dtype)  # [T, S] or [H, T, S], broadcast, in place
        if key_padding_mask is not None:
            scores.masked_fill_(key_padding_mask.view(bsz, 1, 1, src_len).to(torch.bool), float("-inf"))
        if before_softmax:
            return scores.reshape(bsz * heads, tgt_len, src_len), v.reshape(bsz * heads, src_len, head_dim)

        attn, probs_float = self._attend(scores, v)
        attn = self.out_proj(attn.permute(2, 0, 1, 3).reshape(tgt_len, bsz, embed_dim))

        weights: Optional[Tensor] = None
        if need_weights or need_head_weights:
            weights = probs_float.transpose(0, 1)  # [H, B, T, S], as fairseq returns them
            if not need_head_weights:
                weights = weights.mean(dim=0)
        return attn, weights

    def _attend(self, scores: Tensor, v: Tensor) -> Tuple[Tensor, Tensor]:
        """softmax (in float32 for half inputs), dropout, then the values: ``[B, H, T, D]`` and the probabilities."""
        probs_float = utils.softmax(scores, dim=-1, onnx_trace=self.onnx_trace)
        probs = self.dropout_module(probs_float.type_as(scores))
        return torch.matmul(probs, v), probs_float

    def can_fuse(self) -> bool:
        """PyTorch's fused ``scaled_dot_product_attention`` takes an additive mask, not a weight."""
        return self.fused and self.weight_source is None

    def _fused(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], offset: int) -> Tensor:
        """softmax(q k^T + mask) v by ``scaled_dot_product_attention`` (q is already scaled). The
        mask goes in as ``[1, H, T, S]`` (or ``[1, 1, T, S]``): a 4-D mask lets the CPU and CUDA
        fused kernels run, where a 3-D one falls back to PyTorch's unfused reference. ``offset``:
        the first query's position minus the first key's."""
        if mask is not None:
            mask = mask.to(q.dtype)
            mask = mask.view((1,) * (4 - mask.dim()) + tuple(mask.shape))
        dropout = self.dropout_module.p if self.training or self.dropout_module.apply_during_inference else 0.0
        if self.kernel_gradient is not None and self.kernel_gradient.applies(q, k, mask, dropout):
            return self.kernel_gradient(q, k, v, mask, offset)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=1.0)

    def _attend_in_blocks(self, q: Tensor, k: Tensor, v: Tensor, bias: BlockedBias) -> Tensor:
        """Attention one block of queries at a time against the keys it can see: the largest score
        tensor is ``[B, H, block, keys seen]``, and keys outside a window are skipped."""
        pieces = []
        for start, end, key_start in bias.spans():
            if self.can_fuse():
                mask = bias.block("bias", start, end, key_start, q.dtype, q.device)
                pieces.append(self._fused(q[:, :, start:end], k[:, :, key_start:end], v[:, :, key_start:end], mask,
                                          offset=start - key_start))
                continue
            scores = torch.matmul(q[:, :, start:end], k[:, :, key_start:end].transpose(-1, -2))
            if self.weight_source is not None:
                scores = scores * bias.block("weight", start, end, key_start, q.dtype, q.device)
            scores += bias.block("bias", start, end, key_start, q.dtype, q.device)
            pieces.append(self._attend(scores, v[:, :, key_start:end])[0])
        return torch.cat(pieces, dim=2)
