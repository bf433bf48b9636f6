"""Rotary position embeddings, applied to queries and keys inside self-attention."""

import math
from typing import List, Tuple

import torch
from torch import Tensor, nn

from kerple_core.errors import KernelConfigError

ROTARY_BASE = 10000.0
#: xPos's default scale base (its ``scale_base``)
XPOS_SCALE_BASE = 512.0
#: evaluation-time scalings of the rotation (NTK-aware, from the evaluated or the current length; YaRN;
#: ReRoPE and its leaky variant)
ROTARY_SCALINGS = ("none", "ntk", "dynamic-ntk", "yarn", "rerope", "leaky-rerope")
RE_ROPE = ("rerope", "leaky-rerope")
#: ReRoPE's window, as a fraction of the training length when --rerope-window is 0 (the reference's
#: best reported window, 1024 on Llama 2 trained at 4096), and leaky ReRoPE's k (its reported k = 16)
REROPE_WINDOW_FRACTION, REROPE_LEAK = 4, 16.0
#: ReRoPE's query scale beyond the training length: ``log`` (the reference's ``max(1, log(i + 1) / log L_train)``)
#: or ``none``
REROPE_QUERY_SCALES = ("log", "none")
#: dynamic NTK: positions per band of queries that share one scale
DYNAMIC_NTK_STEP = 16
#: YaRN's correction range: dimensions of more than 32 rotations over the training length are kept,
#: of fewer than 1 interpolated (its beta_fast, beta_slow)
YARN_BETA_FAST, YARN_BETA_SLOW = 32, 1


class RotaryEmbedding(nn.Module):
    """RoPE (Su et al., RoFormer, 2021, §3.4.2): rotate each pair of features of a
    query or key at position ``m`` by the angle ``m * theta_k``,
    ``theta_k = 10000^(-2k/D)``, so that ``q_m . k_n`` depends on ``m - n`` only.

    Features are paired as ``(x_k, x_{k + D/2})`` (the GPT-NeoX layout, which
    KERPLE's and Sandwich's rotary baselines use). Angles are computed in
    float64, their cosines and sines cast once to the activations' dtype. No
    parameters: checkpoints are unchanged by it.

    p-RoPE (Barbero et al., ICLR 2025, "Round and Round We Go! What makes Rotary Positional Encodings
    useful?"): ``fraction`` ``p`` rotates the first ``floor(p D / 2)`` pairs, those of the highest
    frequencies, with their usual ``theta_k``, and leaves the others unrotated (``theta_k = 0``):
    ``p = 1`` is RoPE, ``p = 0`` no position at all (NoPE).
    """

    def __init__(self, head_dim: int, xpos: bool = False, xpos_scale_base: float = XPOS_SCALE_BASE,
                 scaling: str = "none", train_length: int = 0, scaling_length: int = 0,
                 dynamic_step: int = DYNAMIC_NTK_STEP, rerope_window: int = 0, rerope_leak: float = REROPE_LEAK,
                 rerope_query_scale: str = "log", fraction: float = 1.0):
        super().__init__()
        if head_dim % 2:
            raise KernelConfigError(f"rotary embeddings need an even head dimension, got {head_dim}")
        if xpos_scale_base <= 0:
            raise KernelConfigError(f"--xpos-scale-base must be > 0, got {xpos_scale_base}")
        if not 0.0 <= fraction <= 1.0:
            raise KernelConfigError(f"--rotary-fraction must be in [0, 1] (1: every pair rotated), got {fraction}")
        if fraction < 1.0 and xpos:
            raise KernelConfigError("--rotary-fraction is for plain rotary models, not with --rotary-xpos")
        self.head_dim = head_dim
        self.rotated_pairs = int(fraction * head_dim // 2)
        self.xpos = xpos
        self.xpos_scale_base = float(xpos_scale_base)
        if dynamic_step < 1:
            raise KernelConfigError(f"--dynamic-ntk-step must be >= 1, got {dynamic_step}")
        self.dynamic_step = dynamic_step
        if rerope_window < 0:
            raise KernelConfigError(f"--rerope-window must be >= 0 (0: a quarter of the training length), "
                                    f"got {rerope_window}")
        if not rerope_leak > 1:
            raise KernelConfigError(f"--rerope-leak must be > 1, got {rerope_leak}")
        if rerope_query_scale not in REROPE_QUERY_SCALES:
            raise KernelConfigError(f"--rerope-query-scale must be one of {', '.join(REROPE_QUERY_SCALES)}, "
                                    f"got {rerope_query_scale!r}")
        self.rerope_window, self.rerope_leak = rerope_window, float(rerope_leak)
        self.rerope_query_scale = str(rerope_query_scale)
        self.set_scaling(scaling, train_length, scaling_length)

    def set_scaling(self, scaling: str, train_length: int, scaling_length: int = 0) -> None:
        """Scale the rotation for lengths beyond ``train_length`` (also on a trained model, at
        evaluation): ``ntk`` and ``yarn`` by ``s = max(1, scaling_length / train_length)`` (0: ``s = 1``),
        ``dynamic-ntk`` by the scale of each query's own position (:meth:`dynamic_scale`)."""
        if scaling not in ROTARY_SCALINGS:
            raise KernelConfigError(f"unknown --rotary-scaling {scaling!r}; choose one of: {', '.join(ROTARY_SCALINGS)}")
        if scaling != "none" and train_length < 1:
            raise KernelConfigError(f"--rotary-scaling {scaling} needs the training length (--tokens-per-sample)")
        if scaling_length < 0:
            raise KernelConfigError(f"--rotary-scaling-length must be >= 0, got {scaling_length}")
        if scaling in RE_ROPE and self.rerope_query_scale == "log" and train_length < 2:
            raise KernelConfigError(f"--rotary-scaling {scaling} scales queries by log(i + 1) / log(training length): "
                                    "it needs --tokens-per-sample >= 2 (or --rerope-query-scale none)")
        if scaling in RE_ROPE and self.xpos:
            raise KernelConfigError(f"--rotary-scaling {scaling} is for plain rotary models, not with --rotary-xpos")
        self.scaling, self.train_length, self.scaling_length = scaling, train_length, scaling_length

    @property
    def dynamic(self) -> bool:
        return self.scaling == "dynamic-ntk"

    def scale_factor(self) -> float:
        """``s`` of every position: 1 without scaling and under ``dynamic-ntk`` (whose scale is set per
        block of queries, :meth:`per_block`), else ``scaling_length`` over the training length (at least 1)."""
        if self.scaling == "none" or self.dynamic:
            return 1.0
        return max(1.0, self.scaling_length / self.train_length)

    def dynamic_scale(self, position: int) -> float:
        """Dynamic NTK's ``s`` for the query at absolute ``position``: 1 within the training length
        ``L``, beyond it the length the query has reached, rounded up to ``L`` plus a multiple of
        ``dynamic_step``, over ``L``. Every query of one band of ``dynamic_step`` positions shares it,
        so a band attends with one rotation (``dynamic_step`` 1: each query's own length)."""
        beyond = position + 1 - self.train_length
        if beyond <= 0:
            return 1.0
        return (self.train_length + -(-beyond // self.dynamic_step) * self.dynamic_step) / self.train_length

    def band_starts(self, first_position: int, num_queries: int) -> List[int]:
        """Under ``dynamic-ntk``, the indices of the queries (at absolute positions ``first_position ..``)
        that start a band of :meth:`dynamic_scale`: blocks of queries start there."""
        if not self.dynamic:
            return []
        step, length = self.dynamic_step, self.train_length
        first_band = max(0, -(-(first_position - length) // step))
        starts = range(length + first_band * step, first_position + num_queries, step)
        return [p - first_position for p in starts if p > first_position]

    def inverse_frequencies(self, s: float, device=None) -> Tensor:
        """``theta_k`` of each pair ``k``, float64 ``[D/2]``: ``b^(-2k/D)`` with NTK's base
        ``b' = b s^(D / (D - 2))``, or YaRN's ramp between ``theta_k`` and ``theta_k / s``; 0 for the
        pairs p-RoPE leaves unrotated."""
        theta = self._scaled_frequencies(s, device)
        theta[self.rotated_pairs:] = 0.0
        return theta

    def _scaled_frequencies(self, s: float, device=None) -> Tensor:
        dim = self.head_dim
        k = torch.arange(dim // 2, dtype=torch.float64, device=device)
        base = ROTARY_BASE
        if self.scaling in ("ntk", "dynamic-ntk"):
            base = ROTARY_BASE * s ** (dim / (dim - 2))
        theta = base ** (-2.0 * k / dim)
        if self.scaling != "yarn" or s == 1.0:
            return theta
        def correction(rotations: float) -> float:
            return dim * math.log(self.train_length / (2 * math.pi * rotations)) / (2 * math.log(ROTARY_BASE))

        low = max(math.floor(correction(YARN_BETA_FAST)), 0)
        high = min(math.ceil(correction(YARN_BETA_SLOW)), dim - 1)
        ramp = ((k - low) / max(high - low, 1e-3)).clamp(0.0, 1.0)
        return (1 - ramp) * theta + ramp * theta / s

    def magnitude(self, s: float) -> float:
        """YaRN's factor ``0.1 ln s + 1`` on queries and keys (so ``(0.1 ln s + 1)^2`` on the logits); 1 otherwise."""
        return 0.1 * math.log(s) + 1.0 if self.scaling == "yarn" else 1.0

    def forward(self, *xs: Tensor, offset: int = 0) -> Tuple[Tensor, ...]:
        """Rotate each ``x`` (``[..., T, head_dim]``, e.g. queries and keys), whose rows sit at
        positions ``offset .. offset + T - 1``; the angles are computed once for all of them."""
        s = self.scale_factor()
        return tuple(self._rotate(x, offset, self.inverse_frequencies(s, x.device), self.magnitude(s)) for x in xs)

    @classmethod
    def _rotate(cls, x: Tensor, offset: float, frequencies: Tensor, magnitude: float = 1.0) -> Tensor:
        """``x`` ``[..., T, D]`` at positions ``offset ..``, each pair ``k`` rotated by ``position *
        frequencies[k]`` (angles in float64, cast once) and scaled by ``magnitude``."""
        positions = torch.arange(x.size(-2), dtype=torch.float64, device=x.device) + offset
        return cls._turn(x, positions[:, None] * frequencies[None, :], magnitude)

    @staticmethod
    def _turn(x: Tensor, angles: Tensor, magnitude: float = 1.0) -> Tensor:
        """``x`` ``[..., T, D]`` with pair ``k`` of row ``t`` rotated by ``angles[t, k]`` (float64)."""
        half = x.size(-1) // 2
        cos, sin = (angles.cos() * magnitude).to(x.dtype), (angles.sin() * magnitude).to(x.dtype)
        first, second = x[..., :half], x[..., half:]
        return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)

    def per_block(self, q: Tensor, k: Tensor, first_query: int, first_key: int) -> Tuple[Tensor, Tensor]:
        """One block's rotated queries ``[..., T, D]`` (at absolute positions ``first_query ..``) and keys
        ``[..., S, D]`` (at ``first_key ..``) with what depends on the block: dynamic NTK's rotation at
        the block's scale and xPos's decay (:meth:`decay`). Unchanged without either.

        Dynamic NTK (the "dynamic" NTK-aware scaling of bloc97 and emozilla, 2023): the query at
        position ``i`` attends with the base ``b s_i^(D / (D - 2))``, ``s_i`` from the length it has
        reached (:meth:`dynamic_scale`), against every key rotated with that base. Queries and keys
        arrive rotated with the trained frequencies ``theta``, so the rotation by ``position *
        (theta(s) - theta)`` completes it. A token's output then depends only on the tokens before
        it, and decoding one token at a time equals scoring the whole sequence."""
        if self.dynamic:
            s = self.dynamic_scale(first_query + q.size(-2) - 1)
            if s > 1.0:
                extra = self.inverse_frequencies(s, q.device) - self.inverse_frequencies(1.0, q.device)
                q, k = self._rotate(q, first_query, extra), self._rotate(k, first_key, extra)
        return self.decay(q, k, first_query, first_key)

    def rerope_window_size(self) -> int:
        """ReRoPE's window ``w``: --rerope-window, or a quarter of the training length."""
        return self.rerope_window or max(1, self.train_length // REROPE_WINDOW_FRACTION)

    def logit_transform(self, q: Tensor, k: Tensor, first_query: int, first_key: int):
        """ReRoPE's score transform of one block of rotated queries (at absolute positions
        ``first_query ..``) and keys (at ``first_key ..``), None under any other scaling.

        ReRoPE (Su, 2023, bojone/rerope): the logit of query ``i`` and key ``j`` is the rotary logit
        at the relative position ``i - j`` below the window ``w``, and at ``w`` from it on; leaky
        ReRoPE (``leaky-rerope``) uses ``w + (i - j - w) / k`` there. The reference computes a second
        logit matrix from queries rotated to position ``w`` and unrotated keys (leaky: both at
        positions interpolated by ``1/k``) and merges the two by the mask ``i - j < w``. Here the
        second matrix comes from the rotated queries and keys turned further, the query at ``i`` by
        ``(w + (i - w)/k - i) theta`` and the key at ``j`` by ``(j/k - j) theta`` (``1/k = 0``: ReRoPE),
        so the cache keeps rotated keys as for plain rotary. As the reference's patches do, the query at
        ``i`` is also scaled by ``max(1, log(i + 1) / log L_train)`` (``--rerope-query-scale log``, the
        default; ``none`` leaves it). Every logit is the reference's; two ``queries x keys`` matrices per
        block, on the explicit path."""
        if self.scaling not in RE_ROPE:
            return None
        window = self.rerope_window_size()
        slope = 1.0 / self.rerope_leak if self.scaling == "leaky-rerope" else 0.0
        theta = self.inverse_frequencies(1.0, q.device)
        query_positions = torch.arange(q.size(-2), dtype=torch.float64, device=q.device) + first_query
        key_positions = torch.arange(k.size(-2), dtype=torch.float64, device=q.device) + first_key
        q_far = self._turn(q, (window * (1 - slope) + query_positions * (slope - 1))[:, None] * theta[None])
        k_far = self._turn(k, (key_positions * (slope - 1))[:, None] * theta[None])
        near = (query_positions[:, None] - key_positions[None, :]) < window

        scale = None
        if self.rerope_query_scale == "log":
            scale = (query_positions + 1).log().div(math.log(self.train_length)).clamp(min=1.0)[:, None]

        def rerope_logits(q_block: Tensor, scores: Tensor, mask: Tensor) -> Tensor:
            far = torch.matmul(q_far, k_far.transpose(-1, -2))
            logits = torch.where(near, scores, far.to(scores.dtype))
            return (logits if scale is None else logits * scale.to(scores.dtype)) + mask

        return rerope_logits

    def xpos_zeta(self, device=None) -> Tensor:
        """``zeta_k = (2k + 0.4 D) / (1.4 D)`` of each pair ``k``, float64 ``[D/2]``."""
        k = torch.arange(self.head_dim // 2, dtype=torch.float64, device=device)
        return (2 * k + 0.4 * self.head_dim) / (1.4 * self.head_dim)

    def decay(self, q: Tensor, k: Tensor, first_query: int, first_key: int) -> Tuple[Tensor, Tensor]:
        """xPos's decay of one block of rotated queries ``[..., T, D]`` at absolute positions
        ``first_query ..`` and keys ``[..., S, D]`` at ``first_key ..``: pair ``k`` of the logit of
        query ``n`` and key ``m`` is multiplied by ``zeta_k^((n - m) / scale_base)`` (Sun et al., "A
        Length-Extrapolatable Transformer", 2023, §3.2). Unchanged without ``xpos``.

        The reference scales the query by ``zeta^(n / scale_base)`` and the key by
        ``zeta^(-m / scale_base)``, which overflow (keys) and underflow (queries) in fp16 at long
        positions. Both are measured here from the block's last query ``c`` instead:
        ``zeta^((n - c) / scale_base)`` (at most ``zeta_0^(-block / scale_base)``, 12 for a block of
        1024 queries) and ``zeta^((c - m) / scale_base)`` (at most 1); the product is the same. The
        cache keeps the keys before this scaling."""
        if not self.xpos:
            return q, k
        zeta = self.xpos_zeta(q.device)
        last_query = first_query + q.size(-2) - 1
        query_steps = torch.arange(first_query - last_query, 1, dtype=torch.float64, device=q.device)
        key_steps = torch.arange(last_query - first_key, last_query - first_key - k.size(-2), -1,
                                 dtype=torch.float64, device=q.device)

        def scales(steps: Tensor, dtype: torch.dtype) -> Tensor:
            per_pair = zeta[None, :] ** (steps[:, None] / self.xpos_scale_base)  # [T, D/2]
            return torch.cat([per_pair, per_pair], dim=-1).to(dtype)  # pairs (k, k + D/2)

        return q * scales(query_steps, q.dtype), k * scales(key_steps, k.dtype)

    def extra_repr(self) -> str:
        xpos = f", xpos (scale base {self.xpos_scale_base:g})" if self.xpos else ""
        scaling = f", {self.scaling} scaling (trained at {self.train_length})" if self.scaling != "none" else ""
        if self.scaling in RE_ROPE:
            scaling += f", window {self.rerope_window_size()}"
            scaling += f", k {self.rerope_leak:g}" if self.scaling == "leaky-rerope" else ""
            scaling += ", queries times max(1, log(i + 1) / log L_train)" if self.rerope_query_scale == "log" else ""
        if self.dynamic:
            scaling += f" in bands of {self.dynamic_step}"
        return f"head_dim={self.head_dim}{xpos}{scaling}"
