"""The shared form of the methods that multiply each query by a factor of its absolute position alone."""

from typing import ClassVar

import torch
from torch import Tensor

from kerple_core.attention.methods.base import QUERIES, AttentionMethod


class PositionFactor(AttentionMethod):
    """The query at 0-based absolute position ``i`` times ``factor(i)``, computed in float64; no parameters.
    The logits ``q . k`` scale, a positional bias added to them does not, and every backend serves it.
    A subclass implements :meth:`factor`; with ``evaluation_only`` it leaves queries unchanged in
    training mode."""

    acts_on = QUERIES
    precedence = 1  # after a model's learned query scales (an evaluation-time factor)
    #: the factor applies in evaluation mode only (training sees 1)
    evaluation_only: ClassVar[bool] = False

    def factor(self, positions: Tensor) -> Tensor:
        """float64 factors of the float64 0-based ``positions``."""
        raise NotImplementedError

    def scale_queries(self, q: Tensor, first_position: int, visibility) -> Tensor:
        if self.evaluation_only and self.training:
            return q
        positions = torch.arange(first_position, first_position + q.size(2), dtype=torch.float64, device=q.device)
        return q * self.factor(positions).to(q.dtype)[:, None]
