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

TOEPLITZ_ROWS_AT_ONCE = 16  # rows of a non-square bias laid out per copy (bounds the temporary)
FROZEN_CACHE_SIZE = 2  # per kind (bias, weight, and their per-distance lines): each entry is at most heads x L x L


def toeplitz(per_distance: Tensor, query_len: int, key_len: int, future: float, dtype: torch.dtype,
             offset: Optional[int] = None) -> Tensor:
    """``out[h, t, s] = per_distance[h, offset + t - s]``, or ``future`` where ``offset + t - s < 0``;
    one ``[heads, queries, keys]`` allocation in ``dtype``.

    ``offset`` is the position of the first query minus that of the first key; by default
    ``key_len - query_len``: the queries are the last ``query_len`` of the keys' positions.
    ``per_distance`` must cover distances up to ``offset + query_len - 1``.
    """
    if offset is None:
        offset = key_len - query_len
    if query_len <= 0 or key_len <= 0 or offset + query_len - 1 < 0:
        raise ValueError(f"no query sees a key: query_len {query_len}, key_len {key_len}, offset {offset}")
    # line[k] is the value at distance lowest + k, k = 0 .. query_len + key_len - 2;
    # cast once, then each query row is a reversed slice of it
    lowest, highest = offset - (key_len - 1), offset + query_len - 1
    if highest >= per_distance.size(1):
        raise ValueError(f"distances up to {highest} needed, {per_distance.size(1)} given")
    values = per_distance[:, max(lowest, 0): highest + 1]
    ahead = per_distance.new_full((per_distance.size(0), max(0, -lowest)), future)
    line = torch.cat([ahead, values], dim=1).to(dtype)
    # row t, column s holds line[t + key_len - 1 - s]: row r of `rows` is row query_len - 1 - r
    rows = line.flip(-1).unfold(-1, key_len, 1)
    if query_len == key_len or (line.requires_grad and torch.is_grad_enabled()):
        return rows.flip(-2)
    # for a non-square block, flip would keep its input's overlapping strides and leave every
    # row strided, which fused attention then gathers slowly; lay out a few rows at a time
    # (not under autograd, where each partial copy would cost a copy of the whole gradient)
    out = line.new_empty(line.size(0), query_len, key_len)
    for start in range(0, query_len, TOEPLITZ_ROWS_AT_ONCE):
        end = min(start + TOEPLITZ_ROWS_AT_ONCE, query_len)
        out[:, start:end] = rows[:, query_len - end: query_len - start].flip(-2)
    return out


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

    def blocks(self, length: int, block_size: int) -> "BlockedBias":
        """The bias of causal self-attention over ``length`` positions, handed out block by block."""
        return BlockedBias(self, length, block_size)

    def per_distance_line(self, kind: str, length: int, dtype: torch.dtype, device) -> Tensor:
        """``per_distance`` (``kind`` "bias"), the kernel's weight ("weight") or the bias's
        ``tangents`` ("tangents") for distances ``0 .. length - 1``, cast to ``dtype`` once;
        shared like the dense bias."""
        values = {"bias": self.per_distance, "weight": self.weight_per_distance, "tangents": self.tangents}[kind]
        return self._shared(f"{kind} line", lambda q, k, dt, dev: values(k, dev).to(dt), 1, length, dtype, device)

    def per_distance(self, num_distances: int, device=None) -> Tensor:
        """``[heads, num_distances]`` float32: ``B_h(d)`` for ``d = 0 .. num_distances - 1``,
        ``-inf`` from the window on."""
        distances = self._distances(num_distances, device)
        return self._windowed(self.kernel(distances), distances)

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

    def _windowed(self, values: Tensor, distances: Tensor) -> Tensor:
        if 0 < self.window < distances.numel():
            values = values.masked_fill(distances >= self.window, float("-inf"))
        return values

    def build_weight(self, query_len: int, key_len: int, dtype: torch.dtype, device) -> Tensor:
        return toeplitz(self.weight_per_distance(key_len, device), query_len, key_len, 0.0, dtype)

    def weight_per_distance(self, num_distances: int, device=None) -> Tensor:
        """``[heads, num_distances]`` float32: the weight kernel's ``W_h(d)`` for ``d = 0 .. num_distances - 1``."""
        return self.kernel.weight(self._distances(num_distances, device))

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


class BlockedBias:
    """The causal bias (and weight) of self-attention over ``length`` positions without its
    ``[heads, length, length]`` tensor: :meth:`block` lays out only the rows of a block of
    queries against the keys they can see (from ``key_start``; with a window, the window).

    The decoder's ``buffered_future_mask`` returns one for sequences longer than
    ``--attention-block-size``, and :class:`KernelBiasedSelfAttention` computes attention
    one block of queries at a time, so no ``L x L`` tensor exists and, with a window,
    keys outside it are never touched.
    """

    def __init__(self, source: AttentionBias, length: int, block_size: int):
        self.source = source
        self.length = length
        self.block_size = block_size

    @property
    def window(self) -> int:
        return self.source.window

    def spans(self):
        """``(query_start, query_end, key_start)`` of each block; keys end where the queries do."""
        for start in range(0, self.length, self.block_size):
            end = min(start + self.block_size, self.length)
            yield start, end, max(0, start - self.window + 1) if self.window else 0

    def block(self, kind: str, query_start: int, query_end: int, key_start: int, dtype: torch.dtype, device) -> Tensor:
        """``[heads, query_end - query_start, query_end - key_start]`` rows of the bias (``kind``
        "bias", ``-inf`` for future keys) or the weight ("weight", 0 there)."""
        line = self.source.per_distance_line(kind, self.length, dtype, device)
        future = float("-inf") if kind == "bias" else 0.0
        return toeplitz(line, query_end - query_start, query_end - key_start, future, dtype,
                        offset=query_start - key_start)

    def dense(self, dtype: torch.dtype, device) -> Tensor:
        """The whole ``[heads, length, length]`` bias, for the paths that need it."""
        return self.source(self.length, self.length, dtype, device)
