"""Perplexity by position inside non-overlapping blocks of ``L`` tokens (KERPLE §5.5, Fig. 5).

Position ``p`` of a block is predicted from the ``p + 1`` tokens before it in that block,
so the curve shows whether tokens beyond the training length help (the curve keeps
falling), are ignored (it flattens) or hurt (it rises). The reference is the same model
with attention restricted to the training length (KERPLE's "windowed" evaluation).
"""

from typing import Tuple

import numpy as np
import torch

from kerple_fairseq.evaluation import spans as S
from kerple_fairseq.evaluation.scorer import WindowScorer, loss_by_position


def position_wise_loss(model, stream: torch.Tensor, eos: int, length: int, max_tokens: int, device,
                       progress: bool = False) -> Tuple[np.ndarray, np.ndarray]:
    """Mean base-2 loss at positions ``0 .. length-1`` of the early-token-cursed blocks, with counts."""
    inputs = torch.cat([stream.new_tensor([eos]), stream[:-1]])
    scorer = WindowScorer(model, inputs, stream, max_tokens, device, progress=progress)
    scores = scorer.score(S.early_token_cursed(len(stream), length), description=f"position-wise L={length}")
    return loss_by_position(length, scores)


def binned_perplexity(losses: np.ndarray, counts: np.ndarray, bin_width: int) -> Tuple[np.ndarray, np.ndarray]:
    """``2 ** (token-weighted mean loss)`` over consecutive bins of positions; returns (bin centres, ppl)."""
    centres, ppl = [], []
    for lo in range(0, len(losses), bin_width):
        c = counts[lo:lo + bin_width]
        if c.sum() == 0:
            continue
        loss = float((np.nan_to_num(losses[lo:lo + bin_width]) * c).sum() / c.sum())
        centres.append(lo + (min(lo + bin_width, len(losses)) - lo - 1) / 2)
        ppl.append(2.0 ** loss)
    return np.array(centres), np.array(ppl)
