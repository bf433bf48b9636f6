"""Each scored span's summed loss: all that a paired bootstrap of perplexities needs (see
:mod:`kerple_fairseq.analysis.significance`), a few kilobytes where the per-token file of the same
evaluation holds megabytes. A comparison keeps these beside its records so that a finished run can be
carried (committed, copied) without its checkpoint and per-token file and still be ranked and compared.

One ``.npz`` file holds, for each protocol and length: ``loss`` (float64, the summed natural-log loss
of each span's scored tokens), ``count`` (how many tokens each span scored), and in ``meta`` (JSON) a
fingerprint of which tokens were scored in which span, so that spans of different evaluations are
never paired by mistake. No pickled objects: it is read with ``allow_pickle=False``.
"""

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Dict, Tuple

import numpy as np

from kerple_fairseq.errors import UsageError
from kerple_fairseq.evaluation.per_token import TokenScores

FORMAT = "kerple-span-losses-1"


@dataclass
class SpanLosses:
    """One protocol at one length: arrays over the spans, in scoring order."""

    loss: np.ndarray  # [spans] float64
    count: np.ndarray  # [spans] int64
    tokens: str  # fingerprint of the scored tokens' positions and spans

    @classmethod
    def of(cls, scores: TokenScores) -> "SpanLosses":
        num_spans = int(scores.span.max()) + 1 if scores.span.size else 0
        fingerprint = hashlib.sha256()
        for positions in (scores.target, scores.span):
            fingerprint.update(np.ascontiguousarray(positions, dtype=np.int64).tobytes())
        return cls(np.bincount(scores.span, weights=-scores.log_prob.astype(np.float64), minlength=num_spans),
                   np.bincount(scores.span, minlength=num_spans).astype(np.int64), fingerprint.hexdigest()[:16])


def _key(protocol: str, length: int, field: str) -> str:
    return f"{protocol}.{length}.{field}"


def save(path: str, scored: Dict[Tuple[str, int], SpanLosses]) -> None:
    """Written beside, then renamed: the file is there whole or not at all."""
    arrays = {_key(p, n, f): getattr(s, f) for (p, n), s in scored.items() for f in ("loss", "count")}
    meta = {"format": FORMAT, "scored": [[p, n, s.tokens] for (p, n), s in scored.items()]}
    partial = f"{path}.partial"
    with open(partial, "wb") as f:  # a file object: numpy would append .npz to a name without it
        np.savez_compressed(f, meta=np.array(json.dumps(meta)), **arrays)
    os.replace(partial, path)


def load(path: str) -> Dict[Tuple[str, int], SpanLosses]:
    """A file written by :func:`save`; a :class:`UsageError` for anything else."""
    try:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(str(data["meta"]))
            if meta.get("format") != FORMAT:
                raise ValueError(f"format {meta.get('format')!r}")
            return {(p, int(n)): SpanLosses(data[_key(p, n, "loss")], data[_key(p, n, "count")], str(tokens))
                    for p, n, tokens in meta["scored"]}
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(f"{path} is not a file of span losses ({type(e).__name__}: {e}); a comparison writes "
                         "one beside each evaluation's per-token file") from None
