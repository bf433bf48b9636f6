"""Which queries are attended together, and which keys each block of them sees.

One call of self-attention has ``num_queries`` new queries and ``num_keys`` keys (the
cache included); the queries are the last ``num_queries`` positions of the keys. Dense
attention is one block of every query; incremental decoding is one block of the new
queries at an offset; a long sequence is split into blocks of ``block_size`` queries,
so no ``queries x keys`` tensor exists, and a block reads no key before the first one its
first query sees (:class:`~kerple_core.visibility.Visibility`: a window's, a chunk's).
"""

from dataclasses import dataclass
from typing import List, Sequence

import torch
from torch import Tensor

from kerple_core.visibility import GLOBAL, Visibility

#: smallest block of queries under an attention window: smaller blocks cost more in
#: per-block overhead than the keys they skip save
MIN_WINDOW_BLOCK = 64
#: on a CPU, the most scores (batch x heads x queries x keys) one block holds by default where an
#: attention method works on them (``--cpu-attention-block-scores``): a block's tensors then stay in the
#: caches and in memory the allocator reuses (docs/performance.md, "Blocks on a CPU")
CPU_BLOCK_SCORES = 1 << 20
#: the fewest queries a block is cut to for ``CPU_BLOCK_SCORES``
MIN_CPU_BLOCK = 16


@dataclass(frozen=True)
class QueryBlock:
    """Queries ``[query_start, query_end)`` against keys ``[key_start, key_end)`` (indices into
    the call's queries and keys). Query ``t`` and key ``s`` of the block are
    ``offset + t - s`` positions apart; negative means the key is in the query's future."""

    query_start: int
    query_end: int
    key_start: int
    key_end: int
    offset: int

    @property
    def num_queries(self) -> int:
        return self.query_end - self.query_start

    @property
    def num_keys(self) -> int:
        return self.key_end - self.key_start


def diagonal(block: QueryBlock, device) -> Tensor:
    """``[queries, keys]`` bool: each query's own key in the block (query ``t`` is key ``offset + t``)."""
    queries = torch.arange(block.num_queries, device=device)[:, None]
    keys = torch.arange(block.num_keys, device=device)[None, :]
    return keys == block.offset + queries


def effective_block_size(block_size: int, attention_window: int, scores_per_query: int = 0,
                         max_scores: int = 0) -> int:
    """Queries per block (0: one block): ``block_size``, or under a window of ``w`` keys at most
    ``max(w, MIN_WINDOW_BLOCK)``, so that the keys outside the window are skipped; with
    ``max_scores``, at most ``max_scores // scores_per_query`` (but ``MIN_CPU_BLOCK``), so that a
    block's ``[batch, heads, queries, keys]`` holds about ``max_scores`` scores at most
    (``scores_per_query``: batch x heads x keys)."""
    if block_size > 0 and attention_window > 0:
        block_size = min(block_size, max(attention_window, MIN_WINDOW_BLOCK))
    if block_size > 0 and max_scores > 0 and scores_per_query > 0:
        block_size = min(block_size, max(MIN_CPU_BLOCK, max_scores // scores_per_query))
    return block_size


def query_blocks(num_queries: int, num_keys: int, block_size: int = 0, visibility: Visibility = GLOBAL,
                 starts: Sequence[int] = (), key_position: int = 0) -> List[QueryBlock]:
    """The blocks of one call: all queries at once when ``block_size`` is 0 or covers them,
    otherwise consecutive blocks of ``block_size`` queries; a block also starts at each query
    index in ``starts`` (queries that must not share a block with the ones before them). A
    block's keys end with its last query (causality) and start at the first key its first query
    sees under ``visibility``; ``key_position``: the absolute position of the call's key 0 (a
    chunk's keys depend on it)."""
    if num_queries < 1 or num_keys < num_queries:
        raise ValueError(f"{num_queries} queries need at least as many keys, got {num_keys}")
    first_position = num_keys - num_queries  # of query 0, counted from key 0
    size = block_size if 0 < block_size < num_queries else num_queries
    bounds = sorted(set(range(0, num_queries, size)) | {t for t in starts if 0 < t < num_queries})
    blocks = []
    for start, end in zip(bounds, bounds[1:] + [num_queries]):
        position = first_position + start
        key_start = max(0, visibility.first_key_at(key_position + position) - key_position) \
            if visibility.window or visibility.by_position else 0
        blocks.append(QueryBlock(start, end, key_start, first_position + end, position - key_start))
    return blocks
