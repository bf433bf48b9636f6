"""Chunked attention: each query sees the earlier keys of its own chunk of positions only."""

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from kerple_core.attention.blocks import QueryBlock
from kerple_core.errors import KernelConfigError
from kerple_core.layer_biases.base import LayerBias, register_layer_bias

#: Llama 4's ``attention_chunk_size`` (transformers' ``Llama4TextConfig``)
LLAMA4_CHUNK_SIZE = 8192


@dataclass
class ChunkedOptions:
    attn_chunk_size: int = field(default=LLAMA4_CHUNK_SIZE, metadata={
        "help": "chunked attention: positions per chunk C; the query at position i sees the keys j <= i with "
        "floor(j / C) = floor(i / C) (Llama 4's attention_chunk_size, 8192)"})


@register_layer_bias("chunked")
class ChunkedAttention(LayerBias):
    """``b(i, j) = 0`` if ``floor(i / C) = floor(j / C)``, ``-inf`` otherwise (with the causal mask, ``j <= i``):
    the sequence is cut into chunks of ``C`` positions counted from its start, and a query attends to the
    keys of its own chunk only, so the first query of a chunk sees itself alone. Llama 4's chunked
    attention in its rotary layers (Meta, 2025; transformers' ``Llama4TextModel`` builds this mask from
    absolute positions, ``attention_chunk_size`` 8192). No parameters and no position information
    beyond the mask; it goes with rotary embeddings in a ``--layer-positions`` entry (``rotary+chunked``).

    Unlike a window, what a query sees depends on its absolute position, so the mask is built per block
    from the positions of its queries and keys; blocks do not skip the keys of earlier chunks (they are
    masked). A method that counts the keys a query sees (SSMax's ``log n``) is refused in such a layer."""

    options = ChunkedOptions
    encodes_position = False
    limits_keys_by_position = True

    def __init__(self, num_heads: int, embed_dim: int, attn_chunk_size: int = LLAMA4_CHUNK_SIZE):
        super().__init__(num_heads, embed_dim)
        if attn_chunk_size < 1:
            raise KernelConfigError(f"--attn-chunk-size must be >= 1 (positions per chunk), got {attn_chunk_size}")
        self.chunk_size = attn_chunk_size
        # no parameters: an empty buffer moves with the module and tells where to build the mask
        self.register_buffer("device_anchor", torch.zeros(0), persistent=False)

    def _first_positions(self, block: QueryBlock, first_position: int):
        """Absolute positions of the block's first query and first key."""
        first_query = first_position + block.query_start
        return first_query, first_query - block.offset

    def score_term(self, block: QueryBlock, first_position: int, state: Optional[Tensor]):
        first_query, first_key = self._first_positions(block, first_position)
        device = self.device_anchor.device
        # one-element tensors (filled on the device, no copy from the host), so one compiled kernel serves every block
        query_start = torch.full((1,), first_query, dtype=torch.int64, device=device)
        key_start = torch.full((1,), first_key, dtype=torch.int64, device=device)
        chunk = torch.full((1,), self.chunk_size, dtype=torch.int64, device=device)
        zero = torch.zeros(1, device=device)

        def term(b, h, query, key):
            same = torch.div(query + query_start[0], chunk[0], rounding_mode="floor") == torch.div(
                key + key_start[0], chunk[0], rounding_mode="floor")
            return torch.where(same, zero[0], float("-inf"))

        return term

    def curves(self, max_distance: int, inputs: Optional[Tensor] = None) -> Tensor:
        """What the last query of a chunk sees: 0 for ``d < C``, ``-inf`` beyond (earlier queries see less)."""
        distances = torch.arange(max_distance + 1)
        row = torch.zeros(max_distance + 1).masked_fill_(distances >= self.chunk_size, float("-inf"))
        return row.expand(self.num_heads, -1).clone()

    def curves_description(self, max_distance: int) -> str:
        return f"chunks of {self.chunk_size}, at a chunk's last query"

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, chunk_size={self.chunk_size}"
