"""Every scored token's loss, saved by ``kerple-eval-lm --per-token FILE`` for paired comparisons.

One ``.npz`` file per model holds, for each protocol and length it evaluated, four arrays over the
scored tokens, in scoring order:

- ``target``: the token's position in the split's stream (what was predicted);
- ``span``: the index of the span that scored it: the unit a paired bootstrap resamples (a block
  for early-token-cursed and sliding, a target for last-token);
- ``position``: its position within that span (how much context it had);
- ``log_prob``: its natural-log probability (float32).

``meta`` (JSON) names the split and holds a fingerprint of its tokens, so that files scored on
different tokens are told apart.
"""

import hashlib
import json
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import numpy as np

from kerple_fairseq.errors import UsageError
from kerple_fairseq.evaluation.spans import ScoredSpan

FORMAT = "kerple-per-token-1"
FIELDS = ("target", "span", "position", "log_prob")


@dataclass
class TokenScores:
    """One protocol at one length: arrays over the scored tokens (see the module docstring)."""

    target: np.ndarray
    span: np.ndarray
    position: np.ndarray
    log_prob: np.ndarray

    @classmethod
    def from_spans(cls, spans: Sequence[ScoredSpan], scores: List[np.ndarray]) -> "TokenScores":
        """The arrays of ``scores[k]``, the log-probabilities of ``spans[k]``'s scored tokens."""
        sizes = [s.size for s in scores]
        span = np.repeat(np.arange(len(spans), dtype=np.int64), sizes)
        target = np.concatenate([np.arange(w.score_from, w.end, dtype=np.int64) for w in spans])
        position = np.concatenate([np.arange(w.score_from - w.start, w.length, dtype=np.int64) for w in spans])
        return cls(target, span, position, np.concatenate(scores).astype(np.float32))


def stream_fingerprint(stream) -> str:
    """A short hash of a split's token ids."""
    return hashlib.sha256(np.ascontiguousarray(np.asarray(stream, dtype=np.int64)).tobytes()).hexdigest()[:16]


def _key(protocol: str, length: int, field: str) -> str:
    return f"{protocol}.{length}.{field}"


def save(path: str, split: str, fingerprint: str, scored: Dict[Tuple[str, int], TokenScores]) -> None:
    arrays = {_key(p, n, f): getattr(s, f) for (p, n), s in scored.items() for f in FIELDS}
    meta = {"format": FORMAT, "split": split, "tokens": fingerprint,
            "scored": [[p, n] for p, n in scored]}
    with open(path, "wb") as f:  # a file object: numpy would append .npz to a name without it
        np.savez_compressed(f, meta=np.array(json.dumps(meta)), **arrays)


@dataclass
class PerTokenFile:
    path: str
    split: str
    fingerprint: str
    scored: Dict[Tuple[str, int], TokenScores]


def load(path: str) -> PerTokenFile:
    """A file written by :func:`save`; a :class:`UsageError` for anything else."""
    try:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(str(data["meta"]))
            if meta.get("format") != FORMAT:
                raise ValueError(f"format {meta.get('format')!r}")
            scored = {(p, int(n)): TokenScores(*(data[_key(p, n, f)] for f in FIELDS)) for p, n in meta["scored"]}
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(f"{path} is not a kerple-eval-lm --per-token file ({type(e).__name__}: {e}); "
                         "write one with kerple-eval-lm --per-token FILE") from None
    return PerTokenFile(path, meta["split"], meta["tokens"], scored)
