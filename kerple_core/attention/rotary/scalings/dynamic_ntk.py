"""Dynamic NTK (``--rotary-scaling dynamic-ntk``; the "dynamic" NTK-aware scaling of bloc97 and emozilla,
2023): the query at position ``i`` attends with NTK's base ``b s_i^(D / (D - 2))``, ``s_i`` from the length
it has reached (:meth:`DynamicNTK.scale`), against every key rotated with that base.

Queries and keys arrive rotated with the trained frequencies ``theta``, so each block of queries turns
them further by ``position * (theta(s) - theta)``. A token's output then depends only on the tokens before
it, and decoding one token at a time equals scoring the whole sequence."""

from dataclasses import dataclass, field
from typing import List

from kerple_core.attention.rotary.rotation import rotate
from kerple_core.attention.rotary.scalings.base import register_rotary_scaling
from kerple_core.attention.rotary.scalings.ntk import NTKAware
from kerple_core.errors import KernelConfigError

#: positions per band of queries that share one scale
DYNAMIC_NTK_STEP = 16


@dataclass
class DynamicNTKOptions:
    dynamic_ntk_step: int = field(default=DYNAMIC_NTK_STEP, metadata={
        "help": "dynamic-ntk: queries beyond the training length share one scale per band of this "
        "many positions (1: every query its own; larger bands attend in fewer, larger blocks)"})


@register_rotary_scaling("dynamic-ntk")
class DynamicNTK(NTKAware):
    options = DynamicNTKOptions
    precedence = 2

    def check_options(self, rotary) -> None:
        if rotary.dynamic_ntk_step < 1:
            raise KernelConfigError(f"--dynamic-ntk-step must be >= 1, got {rotary.dynamic_ntk_step}")

    def scale_factor(self, rotary) -> float:
        """1: the scale is set per block of queries (:meth:`per_block`)."""
        return 1.0

    @staticmethod
    def scale(rotary, position: int) -> float:
        """``s`` of the query at absolute ``position``: 1 within the training length ``L``, beyond it the
        length the query has reached, rounded up to ``L`` plus a multiple of ``--dynamic-ntk-step``, over
        ``L``. Every query of one band of that many positions shares it, so a band attends with one rotation
        (a step of 1: each query's own length)."""
        beyond = position + 1 - rotary.train_length
        if beyond <= 0:
            return 1.0
        step = rotary.dynamic_ntk_step
        return (rotary.train_length + -(-beyond // step) * step) / rotary.train_length

    def band_starts(self, rotary, first_position: int, num_queries: int) -> List[int]:
        """Where each band of one :meth:`scale` starts."""
        step, length = rotary.dynamic_ntk_step, rotary.train_length
        first_band = max(0, -(-(first_position - length) // step))
        starts = range(length + first_band * step, first_position + num_queries, step)
        return [p - first_position for p in starts if p > first_position]

    def per_block(self, rotary, q, k, first_query: int, first_key: int):
        """The block's queries and keys turned to the scale of its last query (one band)."""
        s = self.scale(rotary, first_query + q.size(-2) - 1)
        if s > 1.0:
            extra = rotary.inverse_frequencies(s, q.device) - rotary.inverse_frequencies(1.0, q.device)
            q, k = rotate(q, first_query, extra), rotate(k, first_key, extra)
        return q, k

    def describe(self, rotary) -> str:
        return super().describe(rotary) + f" in bands of {rotary.dynamic_ntk_step}"
