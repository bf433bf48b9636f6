"""The causal ``[heads, queries, keys]`` attention bias (and weight) built from a kernel.

One :class:`AttentionBias` belongs to a decoder and is shared by all its
layers. It builds the bias at most once per forward pass (layers ask for it
one after another) and, while the kernel's parameters are frozen, keeps the
last few biases across forward passes. Weight kernels get the same treatment
for their ``[heads, queries, keys]`` weight.
"""

from collections import OrderedDict
from contextlib import contextmanager
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import Tensor, nn

from kerple_fairseq.errors import KernelConfigError
from kerple_fairseq.kernels import BiasKernel

FROZEN_CACHE_SIZE = 2  # per kind (bias, weight): each entry is heads x L x L


def toeplitz(per_distance: Tensor, query_len: int, key_len: int, future: float, dtype: torch.dtype) -> Tensor:
    """``out[h, t, s] = per_distance[h, i - s]`` for ``s <= i`` and ``future`` for ``s > i``,
    where ``i = key_len - query_len + t``; one ``[heads, queries, keys]`` allocation in ``dtype``."""
    if not 0 < query_len <= key_len:
        raise ValueError(f"need 0 < query_len <= key_len, got {query_len} and {key_len}")
    # line[k] is the value at distance d = k - (query_len - 1): `future` for the future, then d = 0..key_len-1;
    # cast once, then each query row is a reversed slice of it
    ahead = per_distance.new_full((per_distance.size(0), query_len - 1), future)
    line = torch.cat([ahead, per_distance], dim=1).to(dtype)
    # row t, column s holds line[t + key_len - 1 - s]
    return line.flip(-1).unfold(-1, key_len, 1).flip(-2)


class AttentionBias(nn.Module):
    """``mask[h, t, s] = B_h(i - j)`` for ``j <= i`` and ``-inf`` for ``j > i`` (and, with
    ``window = w > 0``, ``-inf`` for ``i - j >= w``); for weight kernels also
    ``weight[h, t, s] = W_h(i - j)``.

    Query ``t`` sits at absolute position ``i = key_len - query_len + t`` and
    key ``s`` at ``j = s``: the queries are the last ``query_len`` positions,
    which covers full-sequence scoring (``query_len == key_len``) and
    incremental decoding (``query_len`` new tokens after a cache). The kernel
    is evaluated once per distance ``0 .. key_len - 1`` in float32, cast once to
    the attention dtype, and laid out as the Toeplitz matrix.
    """

    def __init__(self, kernel: BiasKernel, window: int = 0):
        super().__init__()
        self.kernel = kernel
        self._forward_memo: Optional[Dict[Tuple, Tensor]] = None
        self._frozen_cache: "OrderedDict[Tuple, Tensor]" = OrderedDict()
        self.set_window(window)

    def set_window(self, window: int) -> None:
        """Restrict attention to the ``window`` most recent keys (0: no window), e.g. at evaluation."""
        if window < 0:
            raise KernelConfigError(f"--attn-window must be >= 0 (0: no window), got {window}")
        if self.kernel.requires_window and window == 0:
            raise KernelConfigError(
                f"--bias-kernel {self.kernel.name} needs --attn-window W > 0 (the number of most recent "
                "keys each query sees)")
        self.window = window
        self._frozen_cache.clear()

    @contextmanager
    def forward_scope(self):
        """Within the scope, a bias (or weight) of one shape and dtype is built once and reused."""
        outermost = self._forward_memo is None
        if outermost:
            self._forward_memo = {}
        try:
            yield
        finally:
            if outermost:
                self._forward_memo = None

    def forward(self, query_len: int, key_len: int, dtype: torch.dtype, device) -> Tensor:
        """The ``[heads, query_len, key_len]`` causal mask plus bias."""
        return self._shared("bias", self.build, query_len, key_len, dtype, device)

    def weight(self, query_len: int, key_len: int, dtype: torch.dtype, device) -> Tensor:
        """The ``[heads, query_len, key_len]`` logit weight of a weight kernel (0 for future keys)."""
        return self._shared("weight", self.build_weight, query_len, key_len, dtype, device)

    def build(self, query_len: int, key_len: int, dtype: torch.dtype, device) -> Tensor:
        return toeplitz(self.per_distance(key_len, device), query_len, key_len, float("-inf"), dtype)

    def per_distance(self, num_distances: int, device=None) -> Tensor:
        """``[heads, num_distances]`` float32: ``B_h(d)`` for ``d = 0 .. num_distances - 1``,
        ``-inf`` from the window on."""
        distances = self._distances(num_distances, device)
        values = self.kernel(distances)
        if 0 < self.window < num_distances:
            values = values.masked_fill(distances >= self.window, float("-inf"))
        return values

    def build_weight(self, query_len: int, key_len: int, dtype: torch.dtype, device) -> Tensor:
        per_distance = self.kernel.weight(self._distances(key_len, device))
        return toeplitz(per_distance, query_len, key_len, 0.0, dtype)

    @staticmethod
    def _distances(key_len: int, device) -> Tensor:
        return torch.arange(key_len, device=device, dtype=torch.float32)

    def _shared(self, kind: str, build: Callable, query_len: int, key_len: int, dtype, device) -> Tensor:
        key = (kind, query_len, key_len, dtype, torch.device(device))
        if self._forward_memo is not None and key in self._forward_memo:
            return self._forward_memo[key]
        if self._parameters_frozen():
            tensor = self._from_frozen_cache(key, build)
        else:
            tensor = build(query_len, key_len, dtype, device)
        if self._forward_memo is not None:
            self._forward_memo[key] = tensor
        return tensor

    def _parameters_frozen(self) -> bool:
        return not (torch.is_grad_enabled() and any(p.requires_grad for p in self.kernel.parameters()))

    def _from_frozen_cache(self, key: Tuple, build: Callable) -> Tensor:
        # keyed on the parameter values themselves: optimisers write through .data, which
        # leaves no trace in a tensor's version counter, and there are only a few per head
        values = tuple(tuple(p.detach().flatten().tolist()) for p in self.kernel.parameters())
        cache_key = key + values
        tensor = self._frozen_cache.get(cache_key)
        if tensor is None:
            tensor = build(*key[1:])
            self._frozen_cache[cache_key] = tensor
            same_kind = [k for k in self._frozen_cache if k[0] == key[0]]
            for oldest in same_kind[: len(same_kind) - FROZEN_CACHE_SIZE]:
                del self._frozen_cache[oldest]
        else:
            self._frozen_cache.move_to_end(cache_key)
        return tensor

    def train(self, mode: bool = True):
        # entering or leaving training (fairseq does so around every step and validation) drops the cache
        self._frozen_cache.clear()
        return super().train(mode)

    def _apply(self, fn, *args, **kwargs):
        # moving or casting the module invalidates cached tensors
        self._frozen_cache.clear()
        return super()._apply(fn, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"window={self.window}" if self.window else ""
