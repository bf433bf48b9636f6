"""Chunked attention: each query sees the earlier keys of its own chunk of positions only."""

from dataclasses import dataclass, field
from typing import Dict

from kerple_core.errors import KernelConfigError
from kerple_core.visibility.base import VisibilityRule, register_visibility_rule

#: Llama 4's ``attention_chunk_size`` (transformers' ``Llama4TextConfig``)
LLAMA4_CHUNK_SIZE = 8192


@dataclass
class ChunkedOptions:
    attn_chunk_size: int = field(default=LLAMA4_CHUNK_SIZE, metadata={
        "help": "chunked attention: positions per chunk C; the query at position i sees the keys j <= i with "
        "floor(j / C) = floor(i / C) (Llama 4's attention_chunk_size, 8192)"})


@register_visibility_rule("chunked")
class ChunkedAttention(VisibilityRule):
    """``f(i) = C floor(i / C)``: the query at position ``i`` sees the keys ``j <= i`` with ``floor(j / C) =
    floor(i / C)``. The sequence is cut into chunks of ``C`` positions counted from its start, and a query
    attends to the keys of its own chunk only, so the first query of a chunk sees itself alone. Llama 4's
    chunked attention in its rotary layers (Meta, 2025; transformers' ``Llama4TextModel`` builds this mask
    from absolute positions, ``attention_chunk_size`` 8192). No parameters and no position information
    beyond the mask; it goes with rotary embeddings in a ``--layer-positions`` entry (``rotary+chunked``).
    Blocks of queries read no key before their first query's chunk, and FlexAttention skips the tiles of
    other chunks."""

    options = ChunkedOptions

    def __init__(self, attn_chunk_size: int = LLAMA4_CHUNK_SIZE):
        if attn_chunk_size < 1:
            raise KernelConfigError(f"--attn-chunk-size must be >= 1 (positions per chunk), got {attn_chunk_size}")
        self.chunk_size = attn_chunk_size

    def constants(self) -> Dict[str, int]:
        return {"chunk": self.chunk_size}

    @staticmethod
    def first_key(positions, chunk):
        return positions // chunk * chunk

    def describe(self) -> str:
        return f"chunks of {self.chunk_size}"
