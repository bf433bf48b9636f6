"""Batched scoring of token spans with a fairseq language model."""

import math
import sys
from collections import defaultdict
from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch
from tqdm import tqdm

from kerple_fairseq.evaluation.spans import ScoredSpan

# positions per output-layer call: bounds the [batch, positions, vocab] log-probabilities
OUTPUT_CHUNK_TOKENS = 4096


class WindowScorer:
    """Log-probabilities of the scored targets of each span.

    ``inputs`` and ``targets`` are the split's model inputs and next tokens (see
    :mod:`kerple_fairseq.evaluation.spans`). Spans of equal length are
    batched up to ``max_tokens`` input tokens per forward pass; only scored
    positions go through the output layer, in chunks.
    """

    def __init__(self, model, inputs: torch.Tensor, targets: torch.Tensor, max_tokens: int, device, progress=True):
        self.model = model
        self.inputs = inputs
        self.targets = targets
        self.max_tokens = max_tokens
        self.device = device
        self.progress = progress

    @torch.no_grad()
    def score(self, spans: Sequence[ScoredSpan], description: str = "") -> List[np.ndarray]:
        """Natural-log probabilities of ``targets[w.score_from:w.end]`` for each span ``w``."""
        by_length: Dict[int, List[int]] = defaultdict(list)
        for index, w in enumerate(spans):
            by_length[w.length].append(index)
        results: List[np.ndarray] = [None] * len(spans)
        bar = tqdm(total=len(spans), desc=description, unit="span", file=sys.stderr,
                   disable=not self.progress, mininterval=2.0, leave=False)
        for length, indices in by_length.items():
            batch_size = max(1, self.max_tokens // length)
            for first in range(0, len(indices), batch_size):
                chunk = indices[first:first + batch_size]
                self._score_batch([spans[i] for i in chunk], chunk, results)
                bar.update(len(chunk))
        bar.close()
        return results

    def _score_batch(self, batch: List[ScoredSpan], indices: List[int], results: List[np.ndarray]) -> None:
        src = torch.stack([self.inputs[w.start:w.end] for w in batch]).to(self.device)
        tgt = torch.stack([self.targets[w.start:w.end] for w in batch]).to(self.device)
        offset = min(w.score_from - w.start for w in batch)
        features, extra = self.model(src, features_only=True)
        step = max(1, OUTPUT_CHUNK_TOKENS // len(batch))
        pieces = []
        for lo in range(offset, src.size(1), step):
            hi = min(lo + step, src.size(1))
            logits = self.model.decoder.output_layer(features[:, lo:hi])
            target = tgt[:, lo:hi].contiguous()  # an adaptive softmax views it flat
            lprobs = self.model.get_normalized_probs((logits, extra), log_probs=True, sample={"target": target})
            pieces.append(lprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1).float())
        scored = torch.cat(pieces, dim=1).cpu().numpy()
        for row, (w, index) in enumerate(zip(batch, indices)):
            results[index] = scored[row, w.score_from - w.start - offset:]


def loss_by_position(length: int, scores: List[np.ndarray]) -> Tuple[np.ndarray, np.ndarray]:
    """Mean base-2 loss at positions ``0 .. length-1`` of spans scored from their start, and
    the number of spans reaching each position (a split's last block may be shorter)."""
    sums = np.zeros(length)
    counts = np.zeros(length, dtype=np.int64)
    for s in scores:
        sums[: s.size] -= s.astype(np.float64) / math.log(2)
        counts[: s.size] += 1
    with np.errstate(invalid="ignore", divide="ignore"):
        return sums / counts, counts
