"""Comparing language models: each is trained, then evaluated by kerple-eval-lm under the
early-token-cursed and last-token protocols at several lengths, and the perplexities are tabulated
in markdown. The small CPU comparison and the reproduction of KERPLE's Table 10 both run this."""

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Hashable, List, NamedTuple, Sequence, Tuple

from kerple_fairseq.experiments.paths import SCRIPTS

PROTOCOLS = ("early-token-cursed", "last-token")  # also how kerple-eval-lm's result lines begin


class CommandFailed(Exception):
    """A command of the pipeline exited with a non-zero status."""

    def __init__(self, program: str, returncode: int):
        super().__init__(f"{program} exited with {returncode}")
        self.returncode = returncode


class Model(NamedTuple):
    """One model of a comparison."""

    key: Hashable  # how the results name it
    train: Callable[[], Path]  # trains it (or finds it trained); returns its checkpoint
    eval_flags: Sequence = ()  # more kerple-eval-lm options for it


class Evaluated(NamedTuple):
    checkpoint: Path
    records: List[dict]  # kerple-eval-lm's --results-json: protocol, length, ppl, ...


@dataclass(frozen=True)
class Comparison:
    """The models' common evaluation: ``data_bin``'s validation split at ``lengths``, the last-token
    protocol on ``num_targets`` targets, ``device_flags`` (``--cpu`` or ``--fp16``), each command
    run by ``run`` (which raises :class:`CommandFailed`), and ``announce(model)`` said before each."""

    data_bin: Path
    lengths: Sequence[int]
    num_targets: int
    device_flags: Sequence[str]
    run: Callable[[list], None]
    announce: Callable[[Model], None] = lambda model: None

    def evaluate(self, model: Model, checkpoint: Path) -> List[dict]:
        """kerple-eval-lm's records of every protocol at every length; also in ``eval.json`` beside the checkpoint."""
        results = checkpoint.parent / "eval.json"
        self.run([sys.executable, SCRIPTS / "eval_lm.py", self.data_bin, "--path", checkpoint, "--gen-subset", "valid",
                  "--protocol", "all", "--lengths", *self.lengths, "--num-targets", self.num_targets,
                  "--max-tokens", 16384, "--results-json", results, *self.device_flags, *model.eval_flags])
        return json.loads(results.read_text())

    def train_and_evaluate(self, models: Sequence[Model]) -> Dict[Hashable, Evaluated]:
        """Each model in turn trained, then evaluated; by its key."""
        evaluated = {}
        for model in models:
            checkpoint = model.train()
            self.announce(model)
            evaluated[model.key] = Evaluated(checkpoint, self.evaluate(model, checkpoint))
        return evaluated


def protocol_rows(cells: List[str], records: List[dict]) -> List[Tuple[List[str], Dict[int, float]]]:
    """A model's table rows: its ``cells``, then each protocol and its perplexity by length."""
    return [(cells + [protocol], {r["length"]: r["ppl"] for r in records if r["protocol"] == protocol})
            for protocol in PROTOCOLS]


def markdown_table(columns: List[str], rows: List[Tuple[List[str], Dict[int, float]]], lengths: Sequence[int]) -> str:
    """``columns`` then a column per length; each row its cells then its perplexities (blank where none)."""
    lines = ["| " + " | ".join(columns + [f"L={n}" for n in lengths]) + " |",
             "|" + "---|" * (len(columns) + len(lengths))]
    for cells, ppl in rows:
        lines.append("| " + " | ".join(cells + [f"{ppl[n]:.2f}" if n in ppl else "" for n in lengths]) + " |")
    return "\n".join(lines)
