"""ReRoPE and leaky ReRoPE (``--rotary-scaling rerope``, ``leaky-rerope``; Su, 2023, bojone/rerope), logit
methods: the logit of query ``i`` and key ``j`` is the rotary logit at the relative position ``i - j`` below
the window ``w``, and at ``w`` from it on; leaky ReRoPE uses ``w + (i - j - w) / k`` there. One module for
both: they differ only in the slope ``1/k`` beyond the window (0 for ReRoPE).

The reference computes a second logit matrix from queries rotated to position ``w`` and unrotated keys
(leaky: both at positions interpolated by ``1/k``) and merges the two by the mask ``i - j < w``. Here the
second matrix comes from the rotated queries and keys turned further, the query at ``i`` by
``(w + (i - w)/k - i) theta`` and the key at ``j`` by ``(j/k - j) theta`` (``1/k = 0``: ReRoPE), so the
cache keeps rotated keys as for plain rotary. As the reference's patches do, the query at ``i`` is also
scaled by ``max(1, log(i + 1) / log L_train)`` (``--rerope-query-scale log``, the default; ``none`` leaves
it). Every logit is the reference's; two ``queries x keys`` matrices per block, on the explicit path."""

import math
from dataclasses import dataclass, field

import torch
from fairseq.dataclass import ChoiceEnum
from torch import Tensor

from kerple_core.attention.rotary.rotation import turn
from kerple_core.attention.rotary.scalings.base import RotaryScaling, register_rotary_scaling
from kerple_core.errors import KernelConfigError
from kerple_core.kernels.registry import SAVED_BEFORE

#: ReRoPE's window, as a fraction of the training length when --rerope-window is 0 (the reference's
#: best reported window, 1024 on Llama 2 trained at 4096), and leaky ReRoPE's k (its reported k = 16)
REROPE_WINDOW_FRACTION, REROPE_LEAK = 4, 16.0
#: ReRoPE's query scale beyond the training length: ``log`` (the reference's ``max(1, log(i + 1) / log L_train)``)
#: or ``none``
REROPE_QUERY_SCALES = ("log", "none")


@dataclass
class ReRoPEOptions:
    rerope_window: int = field(default=0, metadata={"help": "ReRoPE's window w (--rotary-scaling rerope, "
                                                    "leaky-rerope); 0: a quarter of the training length"})
    rerope_leak: float = field(default=REROPE_LEAK, metadata={"help": "leaky ReRoPE's k: distances beyond the "
                                                              "window grow by 1/k per position"})
    rerope_query_scale: ChoiceEnum(list(REROPE_QUERY_SCALES)) = field(default="log", metadata={
        "help": "ReRoPE's query scale: log (the reference patches': the query at i times max(1, log(i + 1) "
        "/ log(training length))) or none", SAVED_BEFORE: "none"})


@register_rotary_scaling("rerope")
class ReRoPE(RotaryScaling):
    options = ReRoPEOptions
    precedence = 4
    plain_rotary_only = True
    rewrites_logits = True

    def check_options(self, rotary) -> None:
        if rotary.rerope_window < 0:
            raise KernelConfigError(f"--rerope-window must be >= 0 (0: a quarter of the training length), "
                                    f"got {rotary.rerope_window}")
        if not rotary.rerope_leak > 1:
            raise KernelConfigError(f"--rerope-leak must be > 1, got {rotary.rerope_leak}")
        if str(rotary.rerope_query_scale) not in REROPE_QUERY_SCALES:
            raise KernelConfigError(f"--rerope-query-scale must be one of {', '.join(REROPE_QUERY_SCALES)}, "
                                    f"got {rotary.rerope_query_scale!r}")

    def check_training_length(self, rotary, train_length: int) -> None:
        if str(rotary.rerope_query_scale) == "log" and train_length < 2:
            raise KernelConfigError(f"--rotary-scaling {self.name} scales queries by log(i + 1) / log(training "
                                    "length): it needs --tokens-per-sample >= 2 (or --rerope-query-scale none)")

    def slope(self, rotary) -> float:
        """How far relative positions beyond the window grow per position: 0, they stay at ``w``."""
        return 0.0

    @staticmethod
    def window(rotary) -> int:
        """The window ``w``: --rerope-window, or a quarter of the training length."""
        return rotary.rerope_window or max(1, rotary.train_length // REROPE_WINDOW_FRACTION)

    def logit_transform(self, rotary, q: Tensor, k: Tensor, first_query: int, first_key: int):
        window, slope = self.window(rotary), self.slope(rotary)
        theta = rotary.inverse_frequencies(1.0, q.device)
        query_positions = torch.arange(q.size(-2), dtype=torch.float64, device=q.device) + first_query
        key_positions = torch.arange(k.size(-2), dtype=torch.float64, device=q.device) + first_key
        q_far = turn(q, (window * (1 - slope) + query_positions * (slope - 1))[:, None] * theta[None])
        k_far = turn(k, (key_positions * (slope - 1))[:, None] * theta[None])
        near = (query_positions[:, None] - key_positions[None, :]) < window

        scale = None
        if str(rotary.rerope_query_scale) == "log":
            scale = (query_positions + 1).log().div(math.log(rotary.train_length)).clamp(min=1.0)[:, None]

        def rerope_logits(q_block: Tensor, scores: Tensor, mask: Tensor) -> Tensor:
            far = torch.matmul(q_far, k_far.transpose(-1, -2))
            logits = torch.where(near, scores, far.to(scores.dtype))
            return (logits if scale is None else logits * scale.to(scores.dtype)) + mask

        return rerope_logits

    def describe(self, rotary) -> str:
        query_scale = ", queries times max(1, log(i + 1) / log L_train)" if str(rotary.rerope_query_scale) == "log" \
            else ""
        return super().describe(rotary) + f", window {self.window(rotary)}{self.leak(rotary)}{query_scale}"

    def leak(self, rotary) -> str:
        """Its leak, as the ``repr`` says it."""
        return ""


@register_rotary_scaling("leaky-rerope")
class LeakyReRoPE(ReRoPE):
    precedence = 5

    def slope(self, rotary) -> float:
        """``1/k``: relative positions beyond the window grow by ``1/k`` per position."""
        return 1.0 / float(rotary.rerope_leak)

    def leak(self, rotary) -> str:
        return f", k {float(rotary.rerope_leak):g}"
