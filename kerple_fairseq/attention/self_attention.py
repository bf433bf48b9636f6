"""The self-attention module of the plugin's decoder layers."""

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
from fairseq.modules import MultiheadAttention
from torch import Tensor, nn

from kerple_fairseq.attention.attend import attend, biased_scores
from kerple_fairseq.attention.blocks import effective_block_size, query_blocks
from kerple_fairseq.attention.distance_bias import DistanceBias, DistanceBlockBias
from kerple_fairseq.attention.layer_bias import LayerBlockBias
from kerple_fairseq.attention.rotary import RotaryEmbedding
from kerple_fairseq.attention.selective import SelectionSums


@dataclass
class AttentionSetup:
    """How every layer of one decoder attends. The decoder builds it once and owns the modules in
    it (the bias's parameters are registered once, in the decoder); each layer keeps a reference.

    ``block_size``: queries per block for long sequences (0: one block); ``backend``: the attention
    backend asked for (:data:`~kerple_fairseq.attention.attend.BACKENDS`); ``cache_size``: incremental decoding keeps only this many most recent keys
    (0: all of them). ``layer_bias`` and ``score_transform`` build a layer's own bias
    (:class:`~kerple_fairseq.layer_biases.LayerBias`, added to ``bias``) and score transform (DAPE,
    CoPE), and ``query_scales`` its query scales (scalable softmax, Llama 4's temperature), called once
    per layer. ``stick_breaking``: stick-breaking weights instead of the softmax; ``selective``:
    selective attention."""

    bias: DistanceBias
    rotary: Optional[RotaryEmbedding] = None
    block_size: int = 0
    backend: str = "auto"
    cache_size: int = 0
    layer_bias: Optional[Callable[[], nn.Module]] = None
    score_transform: Optional[Callable[[], Optional[nn.Module]]] = None
    query_scales: Optional[Callable[[], Optional[nn.ModuleList]]] = None
    stick_breaking: bool = False
    selective: bool = False

    def block_size_now(self) -> int:
        return effective_block_size(self.block_size, self.bias.attention_window)

    def keys_seen(self) -> int:
        """The most keys a query attends to (0: every key before it): the attention window or the cache's."""
        windows = [w for w in (self.bias.attention_window, self.cache_size) if w]
        return min(windows) if windows else 0


class BiasedSelfAttention(MultiheadAttention):
    """fairseq's self-attention with a positional bias (and rotary positions) on every path.

    The forward pass projects, rotates, updates the key/value cache, attends block by block
    (:func:`~kerple_fairseq.attention.attend.attend` picks the backend per block) and projects
    out. The module lays out its own causal bias, so fairseq's ``attn_mask`` must be None (the
    plugin's decoder passes none). The cache has fairseq's layout plus ``positions_seen``, a Python
    int: fairseq decodes every hypothesis of a batch in step, so the position is known on the host
    and read without waiting for the device; with ``setup.cache_size = w`` it
    keeps only the last ``w`` keys and values (Sandwich App. B), and the new query then attends
    as under a window of ``w``. Per-key states are cached beside the keys, trimmed and reordered
    with them: a layer bias's as ``prev_bias_state`` ``[batch, heads, keys]``, selective attention's
    running sums as ``prev_selection`` ``[batch, keys]``.

    Parameters and state-dict keys are those of :class:`MultiheadAttention`, plus ``query_scales.*``
    with scalable softmax.
    """

    def __init__(self, embed_dim: int, num_heads: int, setup: AttentionSetup, dropout: float = 0.0,
                 q_noise: float = 0.0, qn_block_size: int = 8):
        super().__init__(embed_dim, num_heads, dropout=dropout, self_attention=True,
                         q_noise=q_noise, qn_block_size=qn_block_size)
        self.setup = setup
        self.layer_bias = setup.layer_bias() if setup.layer_bias is not None else None
        self.score_transform = setup.score_transform() if setup.score_transform is not None else None
        self.query_scales = setup.query_scales() if setup.query_scales is not None else None

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
        if static_kv or attn_mask is not None:
            raise ValueError("BiasedSelfAttention is causal self-attention with its own bias: static_kv and "
                             "attn_mask are not taken")
        num_queries, batch, embed_dim = query.size()
        q, k, v = self._project(query)
        saved = self._get_input_buffer(incremental_state) if incremental_state is not None else {}
        first_position = saved.get("positions_seen", 0)
        if self.setup.rotary is not None:
            q, k = self.setup.rotary(q, k, offset=first_position)
        for scale in self.query_scales or ():
            q = scale(q, first_position, self.setup.keys_seen())
        states = {}
        state = None if self.layer_bias is None else self.layer_bias.key_state(query, saved.get("prev_bias_state"))
        if state is not None:
            states["prev_bias_state"] = state
        if self.setup.selective:
            states["prev_selection"] = q.new_zeros(batch, num_queries, dtype=self._precise(q.dtype))
        if incremental_state is not None:
            k, v, key_padding_mask, states = self._update_cache(incremental_state, saved, k, v, key_padding_mask,
                                                               first_position + num_queries, states)
        selection = SelectionSums(states["prev_selection"], first_position + num_queries - k.size(2)) \
            if self.setup.selective else None

        need_probabilities = need_weights or need_head_weights
        # probabilities and scores are returned for every (query, key): blocks over all keys
        biases = self._block_biases(num_queries, k.size(2), need_probabilities or before_softmax, first_position,
                                    states.get("prev_bias_state"))
        if before_softmax:
            scores = self._whole_rows(biases, k.size(2), float("-inf"), lambda bias: biased_scores(
                *self._positioned(q, k, bias.block, first_position), bias, key_padding_mask,
                self._block_transform(q, k, bias.block, first_position, selection)))
            return scores.flatten(0, 1), v.flatten(0, 1)
        attended, probabilities = self._attend_block_by_block(q, k, v, biases, key_padding_mask, need_probabilities,
                                                              first_position, selection)
        if selection is not None and incremental_state is not None:
            saved["prev_selection"] = selection.sums  # the sums over every query so far, for the next step
            self._set_input_buffer(incremental_state, saved)
        out = self.out_proj(attended.permute(2, 0, 1, 3).reshape(num_queries, batch, embed_dim))
        return out, self._returned_weights(probabilities, need_head_weights)

    def _project(self, x: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """Queries (scaled by ``1/sqrt(head_dim)``), keys and values, ``[B, H, T, head_dim]``."""
        num_queries, batch, _ = x.size()

        def split_heads(y: Tensor) -> Tensor:
            return y.view(num_queries, batch, self.num_heads, self.head_dim).permute(1, 2, 0, 3)

        return split_heads(self.q_proj(x) * self.scaling), split_heads(self.k_proj(x)), split_heads(self.v_proj(x))

    def _block_biases(self, num_queries: int, num_keys: int, whole_rows: bool, first_position: int,
                      state: Optional[Tensor]) -> List[DistanceBlockBias]:
        """The bias of each block of queries (:func:`query_blocks`); with ``whole_rows``, blocks against
        every key up to their last query, split only where dynamic NTK's bands start. Query 0 is at absolute position ``first_position``; ``state`` is the layer
        bias's state of every key."""
        window = self.setup.bias.attention_window
        rotary = self.setup.rotary
        starts = rotary.band_starts(first_position, num_queries) if rotary is not None else []
        blocks = query_blocks(num_queries, num_keys, 0 if whole_rows else self.setup.block_size_now(),
                              0 if whole_rows else window, starts)
        biases = [self.setup.bias.for_block(block, num_keys, shared=len(blocks) == 1) for block in blocks]
        if self.layer_bias is None:
            return biases
        return [LayerBlockBias(bias, self.layer_bias, first_position, state) for bias in biases]

    def _positioned(self, q: Tensor, k: Tensor, block, first_position: int) -> Tuple[Tensor, Tensor]:
        """A block's queries and keys (sliced from the call's) with what rotary does per block, xPos's
        decay and dynamic NTK's rotation (unchanged without them); query 0 of the call is at absolute
        position ``first_position``."""
        q, k = q[:, :, block.query_start:block.query_end], k[:, :, block.key_start:block.key_end]
        if self.setup.rotary is None:
            return q, k
        first_query = first_position + block.query_start
        return self.setup.rotary.per_block(q, k, first_query, first_query - block.offset)

    @staticmethod
    def _precise(dtype: torch.dtype) -> torch.dtype:
        return torch.float64 if dtype == torch.float64 else torch.float32

    def _block_transform(self, q: Tensor, k: Tensor, block, first_position: int,
                         selection: Optional[SelectionSums]):
        """The score transform of a block, if any: DAPE's or CoPE's, selective attention's or
        ReRoPE's (the configuration allows one of them)."""
        if self.score_transform is not None:
            return self.score_transform
        if selection is not None:
            return selection.transform(block)
        if self.setup.rotary is not None:
            first_query = first_position + block.query_start
            return self.setup.rotary.logit_transform(*self._positioned(q, k, block, first_position), first_query,
                                                     first_query - block.offset)
        return None

    @staticmethod
    def _whole_rows(biases: List[DistanceBlockBias], num_keys: int, fill: float, rows) -> Tensor:
        """``rows(bias)`` ``[B, H, queries, keys]`` of each block, laid out against all ``num_keys``
        keys (``fill`` outside the block's keys) and stacked over the blocks' queries."""
        if len(biases) == 1 and biases[0].block.num_keys == num_keys:
            return rows(biases[0])
        pieces = []
        for bias in biases:
            block, piece = bias.block, rows(bias)
            pieces.append(torch.nn.functional.pad(piece, (block.key_start, num_keys - block.key_end), value=fill))
        return torch.cat(pieces, dim=2)

    def _attend_block_by_block(self, q: Tensor, k: Tensor, v: Tensor, biases: List[DistanceBlockBias],
                               key_padding_mask: Optional[Tensor], need_probabilities: bool, first_position: int,
                               selection: Optional[SelectionSums]):
        """Each block's queries against its keys, in order; the attended values ``[B, H, T, D]`` and,
        with ``need_probabilities``, the probabilities laid out over every key ``[B, H, T, S]``."""
        dropout = self.dropout_module.p if self.training or self.dropout_module.apply_during_inference else 0.0
        pieces, probabilities = [], {}
        for bias in biases:
            block = bias.block
            keys = slice(block.key_start, block.key_end)
            attended, probabilities[block] = attend(
                *self._positioned(q, k, block, first_position), v[:, :, keys], bias,
                preference=self.setup.backend, dropout=dropout,
                key_padding_mask=None if key_padding_mask is None else key_padding_mask[:, keys],
                need_probabilities=need_probabilities,
                score_transform=self._block_transform(q, k, block, first_position, selection),
                stick_breaking=self.setup.stick_breaking)
            pieces.append(attended)
        rows = self._whole_rows(biases, k.size(2), 0.0, lambda bias: probabilities[bias.block]) \
            if need_probabilities else None
        return (pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2)), rows

    def _update_cache(self, incremental_state, saved: Dict[str, Optional[Tensor]], k: Tensor, v: Tensor,
                      key_padding_mask: Optional[Tensor], positions_seen: int, states: Dict[str, Tensor]):
        """Append the new keys, values and per-key states (by cache name, keys along the last
        dimension) to the cache (trimmed to ``setup.cache_size``); returns every key, value, key
        padding and state the new queries attend to."""
        num_queries, batch = k.size(2), k.size(0)
        if "prev_key" in saved:
            k = torch.cat([saved["prev_key"], k], dim=2)
            v = torch.cat([saved["prev_value"], v], dim=2)
            states = {name: torch.cat([saved[name], state], dim=-1) for name, state in states.items()}
        key_padding_mask = MultiheadAttention._append_prev_key_padding_mask(
            key_padding_mask=key_padding_mask, prev_key_padding_mask=saved.get("prev_key_padding_mask"),
            batch_size=batch, src_len=k.size(2), static_kv=False)
        size = self.setup.cache_size
        if size and num_queries > 1:
            raise ValueError("--max-cache-window decodes one token per step, as fairseq's incremental "
                             f"decoding does ({num_queries} given)")
        if size and k.size(2) > size:
            # the new query sees the last `size` keys; older ones are never needed again
            k, v = k[:, :, -size:], v[:, :, -size:]
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask[:, -size:]
            states = {name: state[..., -size:] for name, state in states.items()}
        saved["prev_key"], saved["prev_value"] = k, v
        saved.update(states)
        saved["prev_key_padding_mask"] = key_padding_mask
        saved["positions_seen"] = positions_seen
        self._set_input_buffer(incremental_state, saved)
        return k, v, key_padding_mask, states

    def reorder_incremental_state(self, incremental_state, new_order: Tensor):
        """Beam search: the cached tensors follow ``new_order``; the position is every row's."""
        saved = self._get_input_buffer(incremental_state)
        for key, value in saved.items():
            if isinstance(value, Tensor):
                saved[key] = value.index_select(0, new_order)
        return self._set_input_buffer(incremental_state, saved)

    @staticmethod
    def _returned_weights(probabilities: Optional[Tensor], per_head: bool) -> Optional[Tensor]:
        """fairseq's layout: ``[H, B, T, S]`` per head, else averaged over heads."""
        if probabilities is None:
            return None
        weights = probabilities.transpose(0, 1)
        return weights if per_head else weights.mean(dim=0)
