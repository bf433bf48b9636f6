"""A kernel's bias as the causal bias of blocks of queries: the Toeplitz layout of ``B_h(i - j)``.

One :class:`DistanceBias` belongs to a decoder and serves all its layers. Within a
forward pass (:meth:`DistanceBias.forward_scope`) it evaluates the kernel once per
distance, in float32, casts the values once to the attention dtype, and, where every
layer attends the same single block, lays that block out once. While the kernel's
parameters are frozen (evaluation, generation) it keeps the last few results across
forward passes. No tensor of ``queries x keys`` is built for a sequence split into
several blocks: each block is laid out when it is attended.
"""

from collections import OrderedDict
from contextlib import contextmanager
from typing import Callable, Dict, Optional, Tuple

import dataclasses

import torch
from torch import Tensor

from kerple_core.attention import flex
from kerple_core.attention.block_bias import BlockBias
from kerple_core.attention.blocks import QueryBlock
from kerple_core.attention.frozen import KeepsWhileFrozen
from kerple_core.errors import KernelConfigError
from kerple_core.kernels import BiasKernel
from kerple_core.kernels.base import per_head_column
from kerple_core.precision import precise
from kerple_core.visibility import GLOBAL, Visibility

TOEPLITZ_ROWS_AT_ONCE = 16  # rows of a non-square block laid out per copy (bounds the temporary)
FROZEN_CACHE_SIZE = 2  # results kept per kind while the parameters are frozen


def toeplitz(per_distance: Tensor, query_len: int, key_len: int, future: float, dtype: torch.dtype,
             offset: Optional[int] = None) -> Tensor:
    """``out[h, t, s] = per_distance[h, offset + t - s]``, or ``future`` where ``offset + t - s < 0``;
    one ``[heads, queries, keys]`` allocation in ``dtype``.

    ``offset`` is the distance from the first key to the first query; by default
    ``key_len - query_len``: the queries are the last ``query_len`` of the keys' positions.
    ``per_distance`` must cover distances up to ``offset + query_len - 1``.
    """
    if offset is None:
        offset = key_len - query_len
    if query_len <= 0 or key_len <= 0 or offset + query_len - 1 < 0:
        raise ValueError(f"no query sees a key: query_len {query_len}, key_len {key_len}, offset {offset}")
    # diagonal[k] is the value at distance lowest + k, k = 0 .. query_len + key_len - 2;
    # cast once, then each query row is a reversed slice of it
    lowest, highest = offset - (key_len - 1), offset + query_len - 1
    if highest >= per_distance.size(1):
        raise ValueError(f"distances up to {highest} needed, {per_distance.size(1)} given")
    values = per_distance[:, max(lowest, 0): highest + 1]
    ahead = per_distance.new_full((per_distance.size(0), max(0, -lowest)), future)
    diagonal = torch.cat([ahead, values], dim=1).to(dtype)
    # row t, column s holds diagonal[t + key_len - 1 - s]: row r of `rows` is row query_len - 1 - r
    rows = diagonal.flip(-1).unfold(-1, key_len, 1)
    if query_len == key_len or (diagonal.requires_grad and torch.is_grad_enabled()):
        return rows.flip(-2)
    # for a non-square block, flip would keep its input's overlapping strides and leave every
    # row strided, which fused attention then gathers slowly; lay out a few rows at a time
    # (not under autograd, where each partial copy would cost a copy of the whole gradient)
    out = diagonal.new_empty(diagonal.size(0), query_len, key_len)
    for start in range(0, query_len, TOEPLITZ_ROWS_AT_ONCE):
        end = min(start + TOEPLITZ_ROWS_AT_ONCE, query_len)
        out[:, start:end] = rows[:, query_len - end: query_len - start].flip(-2)
    return out


class DistanceBias(KeepsWhileFrozen):
    """``B_h(i - j)`` for the keys ``j`` query ``i`` sees (``visibility``: at least ``j <= i``), ``-inf``
    for the others; for weight kernels also ``W_h(i - j)``. A window, which depends on the distance
    alone, is laid out with the per-distance values (``-inf`` from ``w`` on); a rule of positions (a
    chunk) is applied to each block's cells.

    :meth:`for_block` hands attention one :class:`DistanceBlockBias` per block of queries.
    """

    def __init__(self, kernel: BiasKernel, visibility: Visibility = GLOBAL):
        super().__init__()
        self.kernel = kernel
        self._forward_memo: Optional[Dict[Tuple, Tensor]] = None
        self._frozen_cache: "OrderedDict[Tuple, Tensor]" = OrderedDict()
        self.set_visibility(visibility)

    def set_visibility(self, visibility: Visibility) -> None:
        """Which keys each query sees; also at evaluation, on a trained model."""
        if self.kernel.requires_window and visibility.window == 0:
            raise KernelConfigError(
                f"--bias-kernel {self.kernel.name} needs --attn-window W > 0 (the number of most recent "
                "keys each query sees)")
        self.visibility = visibility
        self._frozen_cache.clear()

    def set_attention_window(self, attention_window: int) -> None:
        """Let each query see only its ``attention_window`` most recent keys, itself included
        (0: every earlier key), the rest of the visibility kept."""
        self.set_visibility(dataclasses.replace(self.visibility, window=attention_window))

    @property
    def attention_window(self) -> int:
        return self.visibility.window

    @contextmanager
    def forward_scope(self):
        """Within the scope, each per-distance vector and each shared block is built once."""
        outermost = self._forward_memo is None
        if outermost:
            self._forward_memo = {}
        try:
            yield
        finally:
            if outermost:
                self._forward_memo = None

    def for_block(self, block: QueryBlock, num_distances: int, shared: bool,
                  first_query: Optional[int] = None) -> "DistanceBlockBias":
        """The bias of one block of a call whose keys span ``num_distances`` distances
        (the per-distance values are computed once for all its blocks), its first query at position
        ``first_query`` (by default its offset: the block's first key at position 0). ``shared``: every
        layer attends this very block in this forward, so it is laid out once."""
        return DistanceBlockBias(self, block, num_distances, shared,
                                 block.offset if first_query is None else first_query)

    @property
    def parameters_require_grad(self) -> bool:
        """Whether the bias must carry a gradient now (learnable parameters, autograd on)."""
        return torch.is_grad_enabled() and any(p.requires_grad for p in self.kernel.parameters())

    # ---------------------------------------------------------------- per-distance values

    def per_distance(self, num_distances: int, device=None) -> Tensor:
        """``[heads, num_distances]`` float32: ``B_h(d)`` for ``d = 0 .. num_distances - 1``,
        ``-inf`` from the window on."""
        distances = self._distances(num_distances, device)
        return self._windowed(self.kernel(distances), distances)

    def weight_per_distance(self, num_distances: int, device=None) -> Tensor:
        """``[heads, num_distances]`` float32: the weight kernel's ``W_h(d)``."""
        return self.kernel.weight(self._distances(num_distances, device))

    def tangents(self, num_distances: int, device=None) -> Tensor:
        """``[parameters, heads, num_distances]`` float32: ``dB_h(d) / dp_h`` for each of the
        kernel's parameters ``p`` (in ``kernel.parameters()`` order), 0 from the window on.

        Only for kernels with ``per_head_parameters``: one forward-mode derivative per parameter
        (all heads at once, each head's element moving only its own head's bias)."""
        if not self.kernel.per_head_parameters:
            raise TypeError(f"bias kernel {self.kernel.name!r} does not have per-head parameters")
        distances = self._distances(num_distances, device)
        names, values = zip(*((name, p.detach()) for name, p in self.kernel.named_parameters()))

        def bias(*parameters):
            return self._windowed(torch.func.functional_call(self.kernel, dict(zip(names, parameters)), (distances,)),
                                  distances)

        def along(index):
            return tuple(torch.ones_like(v) if i == index else torch.zeros_like(v) for i, v in enumerate(values))

        return torch.stack([torch.func.jvp(bias, values, along(i))[1] for i in range(len(values))])

    def distance_values(self, kind: str, num_distances: int, dtype: torch.dtype, device) -> Tensor:
        """``per_distance`` ("bias"), ``weight_per_distance`` ("weight") or ``tangents``
        ("tangents") for ``num_distances`` distances, cast to ``dtype`` once; built once per
        forward, and kept while the parameters are frozen."""
        compute = {"bias": self.per_distance, "weight": self.weight_per_distance, "tangents": self.tangents}[kind]
        return self.shared((kind, num_distances, dtype, torch.device(device)),
                           lambda: compute(num_distances, device).to(dtype))

    def linear_slopes(self, device) -> Optional[Tensor]:
        """``[heads]`` float32: the slopes of a kernel linear in the distance (``B_h(d) = -m_h d``,
        :meth:`~kerple_core.kernels.BiasKernel.linear_slopes`), kept like the values; None for any other."""
        slopes = self.kernel.linear_slopes()
        if slopes is None:
            return None
        return self.shared(("slopes", torch.device(device)),
                           lambda: per_head_column(slopes, torch.float32, device).view(-1))

    def _windowed(self, values: Tensor, distances: Tensor) -> Tensor:
        if 0 < self.attention_window < distances.numel():
            values = values.masked_fill(distances >= self.attention_window, float("-inf"))
        return values

    @staticmethod
    def _distances(num_distances: int, device) -> Tensor:
        return torch.arange(num_distances, device=device, dtype=torch.float32)

    # ---------------------------------------------------------------- sharing and caching

    def shared(self, key: Tuple, build: Callable[[], Tensor]) -> Tensor:
        """``build()``, once per forward scope and ``key``; while the parameters are frozen, kept
        across forward passes too (the last few per kind, ``key[0]``)."""
        if self._forward_memo is not None and key in self._forward_memo:
            return self._forward_memo[key]
        tensor = build() if self.parameters_require_grad else self._from_frozen_cache(key, build)
        if self._forward_memo is not None:
            self._forward_memo[key] = tensor
        return tensor

    def _from_frozen_cache(self, key: Tuple, build: Callable[[], Tensor]) -> Tensor:
        cache_key = key + self.frozen_key()  # no read of the values (kerple_core.attention.frozen)
        tensor = self._frozen_cache.get(cache_key)
        if tensor is None:
            tensor = self._frozen_cache[cache_key] = build()
            same_kind = [k for k in self._frozen_cache if k[0] == key[0]]
            for oldest in same_kind[: len(same_kind) - FROZEN_CACHE_SIZE]:
                del self._frozen_cache[oldest]
        else:
            self._frozen_cache.move_to_end(cache_key)
        return tensor

    def drop_kept(self) -> None:
        self._frozen_cache.clear()

    def extra_repr(self) -> str:
        return self.visibility.extra_repr()


class DistanceBlockBias(BlockBias):
    """The bias (and weight) of one :class:`QueryBlock`, laid out only by the backend that needs it.

    The fused kernel gradient (:mod:`kerple_core.attention.kernel_gradient`) reads the
    per-distance values, their tangents and the block's offset instead of a laid-out bias; it serves
    only a visibility of distances (a window), whose cells the per-distance values hold.
    ``first_query``: the position of the block's first query.
    """

    def __init__(self, source: DistanceBias, block: QueryBlock, num_distances: int, shared: bool,
                 first_query: int):
        self.source = source
        self.block = block
        self.num_distances = num_distances
        self.shared = shared
        self.first_query = first_query

    @property
    def by_position(self) -> bool:
        """Which keys a query sees depends on the positions (a chunk), beyond the per-distance values."""
        return self.source.visibility.by_position

    @property
    def has_weight(self) -> bool:
        return self.source.kernel.has_weight

    @property
    def requires_grad(self) -> bool:
        return self.source.parameters_require_grad

    @property
    def only_masks(self) -> bool:
        """The bias is 0 wherever it is finite (no bias, a window): scaling it changes nothing."""
        return not self.source.kernel.encodes_position

    @property
    def per_head_parameters(self) -> bool:
        return self.source.kernel.per_head_parameters

    @property
    def parameters(self):
        return list(self.source.kernel.parameters())

    def mask(self, dtype: torch.dtype, device) -> Tensor:
        """``[heads, queries, keys]``: the bias, ``-inf`` for keys a query may not see."""
        return self._laid_out("bias", float("-inf"), dtype, device, hide_unseen=True)

    def weight(self, dtype: torch.dtype, device) -> Optional[Tensor]:
        """``[heads, queries, keys]`` multipliers of the scaled logits (0 for future keys), or
        None for a kernel without weight."""
        return self._laid_out("weight", 0.0, dtype, device) if self.has_weight else None

    def distance_values(self, kind: str, dtype: torch.dtype, device) -> Tensor:
        return self.source.distance_values(kind, self.num_distances, dtype, device)

    def score_mod(self, dtype: torch.dtype, device) -> flex.ScoreMod:
        """FlexAttention's score modification: the per-distance values in float32 (float64 for a
        float64 ``dtype``), read at the block's distances."""
        computed = precise(dtype)
        offset = torch.full((1,), self.block.offset, dtype=torch.int64, device=device)
        values = self.distance_values("bias", computed, device)
        if not self.has_weight:
            return flex.distance_bias(values, offset)
        return flex.weighted_distance_bias(values, self.distance_values("weight", computed, device), offset)

    def block_mask(self, device, key_padding_mask: Optional[Tensor] = None):
        """FlexAttention's block mask of the block: the keys each query sees, and padded keys."""
        block, visibility = self.block, self.source.visibility

        def build():
            return flex.block_mask(visibility, block.num_queries, block.num_keys, block.offset, self.first_query,
                                   device, key_padding_mask)

        if key_padding_mask is not None:
            return build()
        return self.source.shared(("block mask", *self._geometry(), torch.device(device)), build)

    def _geometry(self) -> Tuple:
        """What a laid-out block depends on besides its kind and dtype: its shape and offset, and its
        position where the visibility depends on positions."""
        block = self.block
        return (block.num_queries, block.num_keys, block.offset) + ((self.first_query,) if self.by_position else ())

    def _laid_out(self, kind: str, future: float, dtype, device, hide_unseen: bool = False) -> Tensor:
        block = self.block

        def lay_out():
            laid_out = toeplitz(self.distance_values(kind, dtype, device), block.num_queries, block.num_keys, future,
                                dtype, offset=block.offset)
            if hide_unseen and self.by_position:
                seen = self.source.visibility.seen(self.first_query, block.num_queries,
                                                   self.first_query - block.offset, block.num_keys, device)
                laid_out = laid_out.masked_fill(~seen, float("-inf"))
            return laid_out

        if not self.shared:
            return lay_out()
        key = (f"{kind} block", *self._geometry(), self.num_distances, dtype, torch.device(device))
        return self.source.shared(key, lay_out)
