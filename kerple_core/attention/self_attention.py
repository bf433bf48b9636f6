"""The self-attention module of the plugin's decoder layers."""

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from fairseq.modules import MultiheadAttention
from torch import Tensor, nn

from kerple_core.attention.attend import AttentionRecord, attend
from kerple_core.attention.blocks import effective_block_size, query_blocks
from kerple_core.attention.block_bias import BlockBias
from kerple_core.attention.distance_bias import DistanceBias
from kerple_core.attention.layer_bias import LayerBlockBias
from kerple_core.attention.methods import QUERIES, SCORES, WEIGHTS, AttentionMethod
from kerple_core.attention.rotary import RotaryEmbedding
from kerple_core.visibility import GLOBAL, Visibility


@dataclass
class AttentionSetup:
    """How a layer attends. The decoder builds one per position encoding of its layers and owns the
    modules in it (the bias's parameters are registered once, in the decoder); each layer keeps a
    reference.

    ``block_size``: queries per block for long sequences (0: one block); on a CPU, blocks whose scores
    an attention method works on are cut further to hold at most ``cpu_block_scores`` scores (0: not
    cut); ``backend``: the attention
    backend asked for (:data:`~kerple_core.attention.attend.BACKENDS`). Which keys each query sees
    (causality, a window, a chunk, the cache of incremental decoding) is ``bias.visibility``
    (:attr:`visibility`), the one place it is said. ``layer_bias`` builds a layer's own
    bias (:class:`~kerple_core.layer_biases.LayerBias`, added to ``bias``) and ``methods`` its
    attention methods (:mod:`kerple_core.attention.methods`, in the order they act), called once per
    layer."""

    bias: DistanceBias
    rotary: Optional[RotaryEmbedding] = None
    block_size: int = 0
    cpu_block_scores: int = 0
    backend: str = "auto"
    layer_bias: Optional[Callable[[], nn.Module]] = None
    methods: Sequence[Callable[[], AttentionMethod]] = ()

    @property
    def visibility(self) -> Visibility:
        return self.bias.visibility

    def block_size_now(self, scores_per_query: int = 0) -> int:
        """Queries per block: ``block_size`` under the attention window's limit and, given
        ``scores_per_query`` (batch x heads x keys of explicit blocks on a CPU), ``cpu_block_scores``'s."""
        return effective_block_size(self.block_size, self.visibility.window, scores_per_query,
                                    self.cpu_block_scores)


@contextmanager
def recorded(model: nn.Module, keep_logits: bool = False):
    """One :class:`AttentionRecord` set on every :class:`BiasedSelfAttention` of ``model`` while inside."""
    record = AttentionRecord(keep_logits)
    modules = [m for m in model.modules() if isinstance(m, BiasedSelfAttention)]
    for module in modules:
        module.record = record
    try:
        yield record
    finally:
        for module in modules:
            module.record = None


class BiasedSelfAttention(MultiheadAttention):
    """fairseq's self-attention with a positional bias (and rotary positions) on every path.

    The forward pass is five steps: project; position (rotary, and the attention methods that act on
    the queries); the key/value cache; attend block by block
    (:func:`~kerple_core.attention.attend.attend` picks the backend per block, the methods that act
    on the logits or the weights given to it); project out. The module lays out its own causal bias, so
    fairseq's ``attn_mask`` must be None (the plugin's decoder passes none). The cache has fairseq's
    layout plus ``positions_seen``, a Python int: fairseq decodes every hypothesis of a batch in step,
    so the position is known on the host and read without waiting for the device; with
    ``setup.visibility.cache = w`` it keeps only the last ``w`` keys and values (Sandwich App. B), and the new
    query then attends as under a window of ``w``. Per-key states are cached beside the keys, trimmed
    and reordered with them: a layer bias's as ``prev_bias_state`` ``[batch, heads, keys]``, an
    attention method's under its ``cached_state`` name (selective attention's running sums,
    ``prev_selection`` ``[batch, keys]``). The cache is written once per call, after attending.

    Parameters and state-dict keys are those of :class:`MultiheadAttention`, plus ``layer_bias.*`` and
    the attention methods' where :func:`~kerple_core.attention.methods.layout` puts them
    (``query_scales.<i>.*``, ``score_transform.*``).
    """

    def __init__(self, embed_dim: int, num_heads: int, setup: AttentionSetup, dropout: float = 0.0,
                 q_noise: float = 0.0, qn_block_size: int = 8):
        super().__init__(embed_dim, num_heads, dropout=dropout, self_attention=True,
                         q_noise=q_noise, qn_block_size=qn_block_size)
        self.setup = setup
        self.record: Optional[AttentionRecord] = None
        self.layer_bias = setup.layer_bias() if setup.layer_bias is not None else None
        methods = [build() for build in setup.methods]
        queries = [m for m in methods if m.acts_on == QUERIES]
        self.query_scales = nn.ModuleList(queries) if queries else None
        self.score_transform = next((m for m in methods if m.acts_on == SCORES), None)
        self.attention_weights = next((m for m in methods if m.acts_on == WEIGHTS), None)

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
        if static_kv or attn_mask is not None or before_softmax:
            raise ValueError("BiasedSelfAttention is causal self-attention with its own bias: static_kv, attn_mask "
                             "and before_softmax are not taken (an AttentionRecord keeps the logits)")
        num_queries, batch, embed_dim = query.size()
        q, k, v = self._project(query)
        saved = self._get_input_buffer(incremental_state) if incremental_state is not None else {}
        first_position = saved.get("positions_seen", 0)
        q, k = self._position(q, k, first_position)
        k, v, key_padding_mask, states = self._with_cache(incremental_state is not None, saved, query, q, k, v,
                                                           key_padding_mask)
        need_probabilities = need_weights or need_head_weights
        attended, probabilities = self._attend_block_by_block(q, k, v, key_padding_mask, need_probabilities,
                                                              first_position, states)
        if incremental_state is not None:
            self._write_cache(incremental_state, saved, k, v, key_padding_mask, first_position + num_queries, states)
        out = self.out_proj(attended.permute(2, 0, 1, 3).reshape(num_queries, batch, embed_dim))
        return out, self._returned_weights(probabilities, need_head_weights) if need_probabilities else None

    def _project(self, x: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """Queries (scaled by ``1/sqrt(head_dim)``), keys and values, ``[B, H, T, head_dim]``."""
        num_queries, batch, _ = x.size()

        def split_heads(y: Tensor) -> Tensor:
            return y.view(num_queries, batch, self.num_heads, self.head_dim).permute(1, 2, 0, 3)

        return split_heads(self.q_proj(x) * self.scaling), split_heads(self.k_proj(x)), split_heads(self.v_proj(x))

    def _position(self, q: Tensor, k: Tensor, first_position: int) -> Tuple[Tensor, Tensor]:
        """The rotated queries and keys (query 0 at absolute position ``first_position``), the queries then
        scaled by the attention methods that act on them."""
        if self.setup.rotary is not None:
            q, k = self.setup.rotary(q, k, offset=first_position)
        for method in self.query_scales or ():
            q = method.scale_queries(q, first_position, self.setup.visibility)
        return q, k

    def _with_cache(self, incremental: bool, saved: Dict[str, Optional[Tensor]], query: Tensor, q: Tensor, k: Tensor,
                    v: Tensor, key_padding_mask: Optional[Tensor]):
        """Every key, value, key padding and per-key state (by cache name, keys along the last dimension)
        the new queries attend to: in ``incremental`` decoding the cached ones (``saved``) followed by the
        call's, trimmed to ``setup.visibility.cache``; otherwise the call's."""
        states = {}
        if self.layer_bias is not None:
            state = self.layer_bias.key_state(query, saved.get("prev_bias_state"))
            if state is not None:
                states["prev_bias_state"] = state
        method = self.score_transform
        if method is not None and method.cached_state is not None:
            states[method.cached_state] = method.new_key_state(q, k, query)
        if not incremental:
            return k, v, key_padding_mask, states
        if "prev_key" in saved:
            k = torch.cat([saved["prev_key"], k], dim=2)
            v = torch.cat([saved["prev_value"], v], dim=2)
            states = {name: torch.cat([saved[name], state], dim=-1) for name, state in states.items()}
        key_padding_mask = MultiheadAttention._append_prev_key_padding_mask(
            key_padding_mask=key_padding_mask, prev_key_padding_mask=saved.get("prev_key_padding_mask"),
            batch_size=k.size(0), src_len=k.size(2), static_kv=False)
        size = self.setup.visibility.cache
        if size and q.size(2) > 1:
            raise ValueError("--max-cache-window decodes one token per step, as fairseq's incremental "
                             f"decoding does ({q.size(2)} given)")
        if size and k.size(2) > size:
            # the new query sees the last `size` keys; older ones are never needed again
            k, v = k[:, :, -size:], v[:, :, -size:]
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask[:, -size:]
            states = {name: state[..., -size:] for name, state in states.items()}
        return k, v, key_padding_mask, states

    def _write_cache(self, incremental_state, saved: Dict[str, Optional[Tensor]], k: Tensor, v: Tensor,
                     key_padding_mask: Optional[Tensor], positions_seen: int, states: Dict[str, Tensor]) -> None:
        saved["prev_key"], saved["prev_value"] = k, v
        saved.update(states)
        saved["prev_key_padding_mask"] = key_padding_mask
        saved["positions_seen"] = positions_seen
        self._set_input_buffer(incremental_state, saved)

    def _block_biases(self, q: Tensor, num_keys: int, whole_rows: bool, first_position: int,
                      state: Optional[Tensor], recorded: bool) -> List[BlockBias]:
        """The bias of each block of the queries ``q`` (:func:`query_blocks`); with ``whole_rows``, blocks against
        every key up to their last query, split only where dynamic NTK's bands start. Query 0 is at
        absolute position ``first_position``; ``state`` is the layer bias's state of every key; ``recorded``:
        autograd records the attention. The query methods may scale each block's bias (scalable softmax on
        the whole logit)."""
        visibility = self.setup.visibility
        rotary = self.setup.rotary
        num_queries = q.size(2)
        starts = rotary.band_starts(first_position, num_queries) if rotary is not None else []
        cut = q.device.type == "cpu" and self._scores_worked_on()
        block_size = self.setup.block_size_now(q.size(0) * q.size(1) * num_keys if cut else 0)
        key_position = first_position + num_queries - num_keys  # of the call's key 0
        blocks = query_blocks(num_queries, num_keys, 0 if whole_rows else block_size,
                              GLOBAL if whole_rows else visibility, starts, key_position)
        # every layer attends the same blocks: one block is laid out once for all; several, once for all
        # while autograd records (each layer's backward would keep its own copies), else per layer, one at a time
        shared = len(blocks) == 1 or recorded
        biases = [self.setup.bias.for_block(block, num_keys, shared=shared, first_query=first_position + block.query_start)
                  for block in blocks]
        if self.layer_bias is not None:
            biases = [LayerBlockBias(bias, self.layer_bias, first_position, state) for bias in biases]
        for method in self.query_scales or ():
            biases = [method.scale_bias(bias, first_position, visibility) for bias in biases]
        return biases

    def _scores_worked_on(self) -> bool:
        """Whether an attention method works on every block's scores (a score transform, weights in place
        of the softmax): several tensors of the block's size each, which a CPU computes faster in blocks
        that fit its caches."""
        return self.score_transform is not None or self.attention_weights is not None

    def _positioned(self, q: Tensor, k: Tensor, block, first_position: int):
        """A block's queries and keys (sliced from the call's) with what rotary does per block, xPos's
        decay and dynamic NTK's rotation (unchanged without them), and ReRoPE's score transform of them
        (None without it); query 0 of the call is at absolute position ``first_position``."""
        q, k = q[:, :, block.query_start:block.query_end], k[:, :, block.key_start:block.key_end]
        rotary = self.setup.rotary
        if rotary is None:
            return q, k, None
        first_query = first_position + block.query_start
        q, k = rotary.per_block(q, k, first_query, first_query - block.offset)
        return q, k, rotary.logit_transform(q, k, first_query, first_query - block.offset)

    @staticmethod
    def _whole_rows(biases: List[BlockBias], pieces: List[Tensor], num_keys: int, fill: float) -> Tensor:
        """Each block's ``[B, H, queries, keys]`` piece laid out against all ``num_keys`` keys (``fill``
        outside the block's keys), stacked over the blocks' queries."""
        if len(biases) == 1 and biases[0].block.num_keys == num_keys:
            return pieces[0]
        laid_out = [torch.nn.functional.pad(piece, (bias.block.key_start, num_keys - bias.block.key_end), value=fill)
                    for bias, piece in zip(biases, pieces)]
        return torch.cat(laid_out, dim=2)

    def _attend_block_by_block(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor],
                               need_probabilities: bool, first_position: int, states: Dict[str, Tensor]):
        """Each block's queries against its keys, in order (with probabilities, blocks of whole rows); the
        attended values ``[B, H, T, D]`` and, with ``need_probabilities``, the probabilities laid out over
        every key ``[B, H, T, S]``. ``states``: the per-key states of every key; the logits' method's is
        replaced by its state after the call's queries."""
        num_keys = k.size(2)
        record = self.record
        keep_logits = record is not None and record.keep_logits
        whole_rows = need_probabilities or keep_logits
        biases = self._block_biases(q, num_keys, whole_rows, first_position, states.get("prev_bias_state"),
                                    recorded=torch.is_grad_enabled() and q.requires_grad)
        dropout = self.dropout_module.p if self.training or self.dropout_module.apply_during_inference else 0.0
        method = self.score_transform
        transforms = None if method is None else method.call_transforms(
            states.get(method.cached_state), first_position + q.size(2) - num_keys)
        weights = None if self.attention_weights is None else self.attention_weights.weights
        pieces, probabilities = [], []
        for bias in biases:
            block = bias.block
            keys = slice(block.key_start, block.key_end)
            q_block, k_block, rotary_transform = self._positioned(q, k, block, first_position)
            attended, block_probabilities = attend(
                q_block, k_block, v[:, :, keys], bias, preference="explicit" if keep_logits else self.setup.backend,
                dropout=dropout, key_padding_mask=None if key_padding_mask is None else key_padding_mask[:, keys],
                need_probabilities=whole_rows,
                score_transform=transforms.transform(block) if transforms is not None else rotary_transform,
                weights=weights, record=record)
            pieces.append(attended)
            probabilities.append(block_probabilities)
        if transforms is not None and transforms.state is not None:
            states[method.cached_state] = transforms.state
        rows = self._whole_rows(biases, probabilities, num_keys, 0.0) if whole_rows else None
        if keep_logits:
            block_logits = record.logits[-len(biases):]
            del record.logits[-len(biases):]
            record.logits.append(self._whole_rows(biases, block_logits, num_keys, float("-inf")))
            record.probabilities.append(rows)
        return (pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2)), rows if need_probabilities else None

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
