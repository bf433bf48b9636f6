"""Which tokens each evaluation protocol feeds the model and which it scores.

Everything works on one split as a single token stream ``stream`` (fairseq's
``--sample-break-mode none``: every line's tokens followed by its end-of-sentence
symbol). The model input at stream position ``p`` is the previous token,
``inputs = [eos] + stream[:-1]``, exactly as fairseq's ``TokenBlockDataset``
builds it, so a span ``[start, end)`` of inputs predicts ``stream[start:end]``.

A :class:`ScoredSpan` is such a span of inputs plus the first position whose prediction is
scored; positions before it only provide context.
"""

from dataclasses import dataclass
from typing import List

import numpy as np

PROTOCOLS = ("early-token-cursed", "sliding", "last-token")


@dataclass(frozen=True)
class ScoredSpan:
    start: int  # first input position (inclusive)
    end: int  # last input position (exclusive)
    score_from: int  # first scored target position, start <= score_from < end

    @property
    def length(self) -> int:
        return self.end - self.start


def early_token_cursed(num_tokens: int, length: int) -> List[ScoredSpan]:
    """Consecutive non-overlapping blocks of ``length`` tokens, every token scored.

    Equals ``fairseq-eval-lm --tokens-per-sample L --context-window 0``: the first
    token of a block is predicted from the one token before it, the last from ``L``.
    """
    return [ScoredSpan(s, min(s + length, num_tokens), s) for s in range(0, num_tokens, length)]


def sliding(num_tokens: int, length: int, context_window: int) -> List[ScoredSpan]:
    """fairseq's ``--context-window C`` at ``--tokens-per-sample L``.

    Blocks of ``L - C`` scored tokens, each fed with up to ``C`` tokens before it,
    so every span is at most ``L`` long and the stride is ``L - C``
    (``C = L - 1`` slides one token at a time).
    """
    if not 0 <= context_window < length:
        raise ValueError(f"--context-window must be in [0, {length}) for length {length}, got {context_window}")
    stride = length - context_window
    return [ScoredSpan(max(0, s - context_window), min(s + stride, num_tokens), s)
            for s in range(0, num_tokens, stride)]


def last_token_targets(num_tokens: int, max_length: int, num_targets: int) -> np.ndarray:
    """The ``N`` target positions shared by every length of the last-token protocol.

    Targets need ``max_length - 1`` tokens before them, so they are drawn from
    positions ``max_length - 1 .. num_tokens - 1``: ``N`` positions evenly spaced
    over that range, first and last included (``numpy.linspace``, rounded down).
    Deterministic, and spread over the whole split rather than one article.
    """
    first = max_length - 1
    available = num_tokens - first
    if num_targets < 1:
        raise ValueError(f"--num-targets must be >= 1, got {num_targets}")
    if available < num_targets:
        raise ValueError(
            f"the split has {num_tokens} tokens, so only {max(available, 0)} targets have "
            f"{max_length - 1} tokens before them; lower --num-targets or the largest length"
        )
    targets = np.floor(np.linspace(first, num_tokens - 1, num_targets)).astype(np.int64)
    assert len(np.unique(targets)) == num_targets
    return targets


def last_token(targets: np.ndarray, length: int) -> List[ScoredSpan]:
    """Sandwich §3.4: each target seen after exactly ``L - 1`` tokens, only it scored.

    The span is the ``L`` tokens ending at the target: inputs for positions
    ``t - L + 2 .. t``, i.e. the ``L - 1`` tokens ``stream[t-L+1 .. t-1]``.
    """
    if length < 2:
        raise ValueError("the last-token protocol needs lengths >= 2 (one token of context)")
    return [ScoredSpan(int(t) - length + 2, int(t) + 1, int(t)) for t in targets]
