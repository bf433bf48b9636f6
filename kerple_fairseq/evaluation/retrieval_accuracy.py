"""Accuracy on the retrieval tasks (:mod:`kerple_fairseq.tasks.retrieval`): each answer is right when the
model's most probable next token is it, and a whole answer (an MQAR value, the passkey's digits, a copied
span) when each of its tokens is: what greedy decoding after the true input would give whole.
``kerple-eval-lm --task retrieval`` reports both for every task and length, overall, by depth (how far
back the answer's source lies) and, with ``--depth-bands``, by the band its needle was placed in, the chance of a guess (among all of the task's answer symbols, and among
those the example's input shows), and the answers' log-probabilities, whose mean is the loss fairseq's
``cross_entropy`` and ``fairseq-eval-lm`` give on the same examples.

An example-scores file (``--example-scores``, ``.npz`` read with ``allow_pickle=False``) holds for each task
and length each example's answers and whole answers and how many of each were right (a few kilobytes: what the retrieval
board's paired bootstrap over the examples needs), and in ``meta`` (JSON) what drew the examples, so that
only scores of the same examples are ever paired."""

import json
import math
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from kerple_fairseq.errors import UsageError
from kerple_fairseq.evaluation.loading import load_checkpoint_state
from kerple_fairseq.tasks.retrieval import DICTIONARY_OPTIONS, NAME
from kerple_fairseq.tasks.retrieval_sequences import answer_symbols, shown_answer_symbols, whole_answers

FORMAT = "kerple-example-scores-2"
#: more whole answers than any example holds: example i's whole answer w is numbered i * MAX_WHOLES + w
MAX_WHOLES = 1 << 20


class Answers(NamedTuple):
    """Every answer of one task at one length, in the examples' order."""

    example: np.ndarray  # int64: the example it belongs to
    depth: np.ndarray  # int64: its position minus its source's
    correct: np.ndarray  # bool: the model's most probable token is the answer
    log_prob: np.ndarray  # float64: the natural log of the answer's probability
    whole: np.ndarray  # int64: the whole answer it is part of (numbered across the examples), -1 for none
    choices: np.ndarray  # int64: the symbols an answer of its task is drawn from
    shown: np.ndarray  # int64: how many of them its example's input shows before the first answer
    band: np.ndarray  # int64: the depth band of its example's needle, -1 for none

    @classmethod
    def concatenate(cls, parts: Sequence["Answers"]) -> "Answers":
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in cls._fields))

    def per_example(self) -> "ExampleScores":
        examples, where = np.unique(self.example, return_inverse=True)
        wholes = Wholes.of(self)
        whole_where = np.searchsorted(examples, wholes.example)

        def count(at, weights=None):
            return np.bincount(at, weights=weights, minlength=examples.size).astype(np.int64)

        return ExampleScores(count(where, self.correct), count(where), count(whole_where, wholes.right),
                             count(whole_where))


class Wholes(NamedTuple):
    """Every whole answer of one task at one length (:func:`~kerple_fairseq.tasks.retrieval_sequences.whole_answers`)."""

    example: np.ndarray  # int64: the example it belongs to
    right: np.ndarray  # bool: every token of it is right (greedy decoding after the true input gives it whole)
    depth: np.ndarray  # int64: the deepest of its tokens' depths
    uniform: np.ndarray  # float64: the chance of guessing it whole among all the symbols of its task's answers
    in_context: np.ndarray  # float64: ... among the symbols its example's input shows (a guess in context)
    band: np.ndarray  # int64: the depth band of its example's needle, -1 for none

    @classmethod
    def of(cls, answers: Answers) -> "Wholes":
        kept = answers.whole >= 0
        ids, where = np.unique(answers.whole[kept], return_inverse=True)

        def total(values):
            return np.bincount(where, weights=values[kept].astype(np.float64), minlength=ids.size)

        depth = np.zeros(ids.size, dtype=np.int64)
        np.maximum.at(depth, where, answers.depth[kept])
        band = np.full(ids.size, -1, dtype=np.int64)
        band[where] = answers.band[kept]
        return cls(ids // MAX_WHOLES, total(answers.correct) == total(np.ones_like(answers.depth)), depth,
                   np.exp(-total(np.log(answers.choices))), np.exp(-total(np.log(answers.shown))), band)


class ExampleScores(NamedTuple):
    """One task at one length, example by example, in the examples' order."""

    correct: np.ndarray  # int64: its right answers
    answers: np.ndarray  # int64: its answers
    whole_correct: np.ndarray  # int64: its whole answers right
    wholes: np.ndarray  # int64: its whole answers


@torch.no_grad()
def score(model, dataset, device, max_tokens: int) -> Answers:
    """The answers of every example of a :class:`~kerple_fairseq.tasks.retrieval.RetrievalDataset`, read by
    ``model`` in batches of up to ``max_tokens`` input tokens."""
    batch_size = max(1, max_tokens // dataset.length)
    parts = []
    for first in range(0, len(dataset), batch_size):
        indices = range(first, min(first + batch_size, len(dataset)))
        examples = [dataset.example(i) for i in indices]
        sample = dataset.collater([dataset.item(i, e) for i, e in zip(indices, examples)])
        source, target = sample["net_input"]["src_tokens"].to(device), sample["target"].to(device)
        output = model(source)
        log_probs = model.get_normalized_probs(output, log_probs=True, sample={"target": target}).float()
        answers = target.ne(dataset.pad)
        answer_log_probs = log_probs.gather(-1, target.unsqueeze(-1)).squeeze(-1)[answers]
        correct = log_probs.argmax(-1).eq(target)[answers]
        tasks = [dataset.task_of(i) for i in indices]
        counts = [len(e.answers) for e in examples]
        wholes = [whole_answers(t, n) for t, n in zip(tasks, counts)]
        parts.append(Answers(
            np.concatenate([np.full(n, i) for i, n in zip(indices, counts)]),
            np.concatenate([e.answers + 1 - e.sources for e in examples]),
            correct.cpu().numpy(), answer_log_probs.double().cpu().numpy(),
            np.concatenate([np.where(w < 0, -1, i * MAX_WHOLES + w) for i, w in zip(indices, wholes)]),
            np.concatenate([np.full(n, len(answer_symbols(t, dataset.settings, dataset.alphabet)))
                            for t, n in zip(tasks, counts)]),
            np.concatenate([np.full(n, shown_answer_symbols(t, dataset.settings, dataset.alphabet, e))
                            for t, n, e in zip(tasks, counts, examples)]),
            np.concatenate([np.full(n, e.band) for n, e in zip(counts, examples)])))
    return Answers.concatenate(parts)


def retrieval_training(path: str, otherwise: str) -> dict:
    """The task options the checkpoint at ``path`` was trained with, if on the retrieval task; else one line
    ending in ``otherwise`` (what to do instead)."""
    saved = load_checkpoint_state(path)["cfg"]["task"]
    if saved.get("_name") != NAME:
        raise UsageError(f"{path} was trained with --task {saved.get('_name')}, not {NAME}: {otherwise}")
    return saved


def check_checkpoint_task(path: str, task_cfg) -> None:
    """One line unless the checkpoint at ``path`` was trained on the retrieval task with the dictionary
    ``task_cfg`` builds."""
    saved = retrieval_training(path, "evaluate it on its data-bin without --task retrieval")
    differ = [option for option in DICTIONARY_OPTIONS if saved.get(option) != task_cfg.get(option)]
    if differ:
        flags = " ".join(f"--{o.replace('_', '-')} {saved.get(o)}" for o in DICTIONARY_OPTIONS)
        raise UsageError(f"{path} was trained with other symbols ({', '.join(differ)}): give {flags}")


def depth_bins(train_length: int, longest: int) -> List[Tuple[int, int]]:
    """Depth ranges ``[lo, hi]``: up to the training length, then each doubling of it, to ``longest``."""
    bins, lo, hi = [], 1, train_length
    while lo <= longest:
        bins.append((lo, hi))
        lo, hi = hi + 1, 2 * hi
    return bins


def _mean(values: np.ndarray) -> Optional[float]:
    return float(values.mean()) if values.size else None


def summary(task: str, length: int, answers: Answers, train_length: int) -> Dict:
    """A results record: accuracy and base-2 loss of the answers, the accuracy of the whole answers (None
    where the length holds none), both in each depth range and in each depth band of a needle, and the chance of a guess, token by token and
    whole, among all of the task's answer symbols and among those the input shows."""
    if answers.correct.size == 0:
        raise UsageError(f"{task} at length {length} has no answers")
    wholes = Wholes.of(answers)
    depths = []
    for lo, hi in depth_bins(train_length, int(answers.depth.max())):
        inside = (answers.depth >= lo) & (answers.depth <= hi)
        whole_inside = (wholes.depth >= lo) & (wholes.depth <= hi)
        if inside.any():
            depths.append({"from": lo, "to": hi, "accuracy": float(answers.correct[inside].mean()),
                           "num_answers": int(inside.sum()), "whole_accuracy": _mean(wholes.right[whole_inside]),
                           "num_whole": int(whole_inside.sum())})
    bands = [{"band": int(band), "accuracy": float(answers.correct[answers.band == band].mean()),
              "num_answers": int((answers.band == band).sum()),
              "whole_accuracy": _mean(wholes.right[wholes.band == band]), "num_whole": int((wholes.band == band).sum())}
             for band in np.unique(answers.band[answers.band >= 0])]
    chance = {"per_token": {"uniform": float(np.mean(1.0 / answers.choices)),
                            "in_context": float(np.mean(1.0 / answers.shown))},
              "whole": {"uniform": _mean(wholes.uniform), "in_context": _mean(wholes.in_context)}}
    return {"task": task, "length": length, "accuracy": float(answers.correct.mean()),
            "whole_accuracy": _mean(wholes.right), "loss": float(-answers.log_prob.mean() / math.log(2)),
            "num_answers": int(answers.correct.size), "num_whole": int(wholes.right.size),
            "num_examples": int(np.unique(answers.example).size), "train_length": train_length, "chance": chance,
            "depths": depths, **({"depth_bands": bands} if bands else {})}


def save(path: str, meta: Dict, scores: Dict[Tuple[str, int], ExampleScores]) -> None:
    arrays = {f"{task}/{length}/{field}": getattr(s, field).astype(np.int32)
              for (task, length), s in scores.items() for field in ExampleScores._fields}
    with open(path, "wb") as f:
        np.savez_compressed(f, meta=np.array(json.dumps({"format": FORMAT, **meta})), **arrays)


def load(path: str) -> Tuple[Dict, Dict[Tuple[str, int], ExampleScores]]:
    """What drew the examples, and every task's and length's example scores, of an example-scores file."""
    try:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(str(data["meta"]))
            if not isinstance(meta, dict) or meta.get("format") != FORMAT:
                raise ValueError(f"not a {FORMAT} file")
            keys = {tuple(name.split("/")[:2]) for name in data.files if name != "meta"}
            scores = {(task, int(length)): ExampleScores(*(data[f"{task}/{length}/{field}"].astype(np.int64)
                                                           for field in ExampleScores._fields))
                      for task, length in keys}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # a .npy gives an array, no `with`
        raise UsageError(f"{path} is not a readable example-scores file of kerple-eval-lm --task retrieval "
                         f"({e})") from None
    return meta, scores
