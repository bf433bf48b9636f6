"""The causal ``[heads, queries, keys]`` attention bias built from a kernel.

One :class:`AttentionBias` belongs to a decoder and is shared by all its
layers. It builds the bias at most once per forward pass (layers ask for it
one after another) and, while the kernel's parameters are frozen, keeps the
last few biases across forward passes.
"""

from collections import OrderedDict
from contextlib import contextmanager
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor, nn

from kerple_fairseq.kernels import BiasKernel

FROZEN_CACHE_SIZE = 2


class AttentionBias(nn.Module):
    """``mask[h, t, s] = B_h(i - j)`` for ``j <= i`` and ``-inf`` for ``j > i``.

    Query ``t`` sits at absolute position ``i = key_len - query_len + t`` and
    key ``s`` at ``j = s``: the queries are the last ``query_len`` positions,
    which covers full-sequence scoring (``query_len == key_len``) and
    incremental decoding (``query_len`` new tokens after a cache). The kernel
    is evaluated once per distance ``0 .. key_len - 1`` in float32, cast once to
    the attention dtype, and laid out as the Toeplitz matrix.
    """

    def __init__(self, kernel: BiasKernel):
        super().__init__()
        self.kernel = kernel
        self._forward_memo: Optional[Dict[Tuple, Tensor]] = None
        self._frozen_cache: "OrderedDict[Tuple, Tensor]" = OrderedDict()

    @contextmanager
    def forward_scope(self):
        """Within the scope, a bias of one shape and dtype is built once and reused."""
        outermost = self._forward_memo is None
        if outermost:
            self._forward_memo = {}
        try:
            yield
        finally:
            if outermost:
                self._forward_memo = None

    def forward(self, query_len: int, key_len: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        key = (query_len, key_len, dtype, torch.device(device))
        if self._forward_memo is not None and key in self._forward_memo:
            return self._forward_memo[key]
        if self._parameters_frozen():
            mask = self._from_frozen_cache(key)
        else:
            mask = self.build(query_len, key_len, dtype, device)
        if self._forward_memo is not None:
            self._forward_memo[key] = mask
        return mask

    def build(self, query_len: int, key_len: int, dtype: torch.dtype, device) -> Tensor:
        if not 0 < query_len <= key_len:
            raise ValueError(f"need 0 < query_len <= key_len, got {query_len} and {key_len}")
        distances = torch.arange(key_len, device=device, dtype=torch.float32)
        per_distance = self.kernel(distances)  # [heads, key_len], float32
        # line[k] is the value at distance d = k - (query_len - 1): -inf for the future, then B(0..key_len-1);
        # cast once, then each query row is a reversed slice of it (one [heads, queries, keys] copy)
        future = per_distance.new_full((per_distance.size(0), query_len - 1), float("-inf"))
        line = torch.cat([future, per_distance], dim=1).to(dtype)
        # row t, column s holds line[t + key_len - 1 - s]
        return line.flip(-1).unfold(-1, key_len, 1).flip(-2)

    def _parameters_frozen(self) -> bool:
        return not (torch.is_grad_enabled() and any(p.requires_grad for p in self.kernel.parameters()))

    def _from_frozen_cache(self, key: Tuple) -> Tensor:
        # keyed on the parameter values themselves: optimisers write through .data, which
        # leaves no trace in a tensor's version counter, and there are only a few per head
        values = tuple(tuple(p.detach().flatten().tolist()) for p in self.kernel.parameters())
        cache_key = key + values
        mask = self._frozen_cache.get(cache_key)
        if mask is None:
            mask = self.build(*key)
            self._frozen_cache[cache_key] = mask
            while len(self._frozen_cache) > FROZEN_CACHE_SIZE:
                self._frozen_cache.popitem(last=False)
        else:
            self._frozen_cache.move_to_end(cache_key)
        return mask

    def train(self, mode: bool = True):
        # entering or leaving training (fairseq does so around every step and validation) drops the cache
        self._frozen_cache.clear()
        return super().train(mode)

    def _apply(self, fn, *args, **kwargs):
        # moving or casting the module invalidates cached tensors
        self._frozen_cache.clear()
        return super()._apply(fn, *args, **kwargs)
