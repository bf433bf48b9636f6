"""``--task retrieval``: language modelling of the retrieval tasks (:mod:`.retrieval_sequences`), their
examples drawn from ``--retrieval-seed`` as they are read, no files. ``fairseq-train`` trains on the tasks
of ``--retrieval-tasks`` in turn, ``--tokens-per-sample`` tokens each; every target but the answers is
padding, so fairseq's ``cross_entropy`` criterion, its logged loss and ``fairseq-eval-lm``'s perplexity
are those of the answers alone. ``kerple-eval-lm --task retrieval`` gives their accuracy by length and depth."""

from dataclasses import asdict, dataclass, field
from typing import List, Optional

import numpy as np
import torch
from fairseq.data import Dictionary, FairseqDataset
from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.tasks import FairseqTask, register_task
from omegaconf import II

from kerple_fairseq.errors import UsageError
from kerple_fairseq.tasks.retrieval_sequences import SPLITS, TASKS, Alphabet, Example, Settings, draw, generator

NAME = "retrieval"
MIXES = ("turns", "equal-loss")
#: the stream of an example's random numbers its task is drawn from under ``--train-task-mix equal-loss``
TASK_STREAM = 1
#: the options that fix the dictionary: a model is evaluated with those it was trained with
DICTIONARY_OPTIONS = ("retrieval_vocabulary", "filler_vocabulary")


@dataclass
class RetrievalConfig(FairseqDataclass):
    # fairseq's data-bin argument, which fairseq-eval-lm names in its log: optional here, and refused if given
    data: Optional[str] = field(default=None, metadata={
        "help": "none: the examples are drawn from --retrieval-seed", "argparse_const": ""})
    retrieval_tasks: str = field(default=",".join(TASKS), metadata={
        "help": f"the tasks, comma-separated, their examples in turn: {', '.join(TASKS)}"})
    train_task_mix: ChoiceEnum(list(MIXES)) = field(default="turns", metadata={
        "help": "the training examples' tasks: turns (example i is task i mod n) or equal-loss (each drawn with "
        "a chance inverse to its answers, so that every task gives the loss as many answers)"})
    tokens_per_sample: int = field(default=64, metadata={"help": "the length of every example"})
    retrieval_seed: int = field(default=1, metadata={"help": "the seed the examples are drawn from"})
    train_examples: int = field(default=100_000, metadata={"help": "examples of an epoch (each epoch new ones)"})
    valid_examples: int = field(default=300, metadata={"help": "examples of each task in valid and test"})
    retrieval_vocabulary: int = field(default=Settings.vocabulary, metadata={
        "help": "content symbols (even: MQAR's keys are the first half, its values the second; copy draws from all)"})
    filler_vocabulary: int = field(default=Settings.filler, metadata={"help": "the noise's symbols"})
    mqar_pairs: int = field(default=Settings.pairs, metadata={"help": "MQAR's key-value pairs"})
    mqar_queries: int = field(default=Settings.queries, metadata={"help": "MQAR's queries, of distinct keys"})
    passkey_digits: int = field(default=Settings.passkey_digits, metadata={"help": "the passkey's digits"})
    passkey_depth: Optional[float] = field(default=None, metadata={
        "help": "the share of the noise before the passkey, 0 (first) to 1 (last); default: drawn uniformly"})
    depth_bands: int = field(default=0, metadata={
        "help": "place the needles (MQAR's pairs, the passkey) in this many depth bands, example i in band "
        "(i // tasks) mod bands (in valid and test: each task's examples through them in turn), and report the "
        "accuracy by band; default: 0, drawn uniformly"})
    # what fairseq's language models read from their task's configuration
    add_bos_token: bool = False
    max_target_positions: Optional[int] = II("task.tokens_per_sample")


class RetrievalDataset(FairseqDataset):
    """``size`` examples of ``tasks`` in turn, each drawn when read: a model's input, its targets with
    padding wherever they are not an answer, and the answers' sources."""

    def __init__(self, tasks: List[str], settings: Settings, alphabet: Alphabet, pad: int, seed: int, split: str,
                 length: int, size: int, mix: str = "turns"):
        self.tasks, self.settings, self.alphabet, self.pad = tasks, settings, alphabet, pad
        self.seed, self.split, self.length, self.count, self.offset = seed, split, length, size, 0
        inverse = np.array([1.0 / settings.answers(task, length) for task in tasks])
        self.chances = inverse / inverse.sum() if mix == "equal-loss" else None

    def task_of(self, index: int) -> str:
        """The task of example ``index``: in turn, or drawn with :attr:`chances`."""
        if self.chances is None:
            return self.tasks[index % len(self.tasks)]
        rng = generator(self.seed, self.split, self.length, self.offset + index, TASK_STREAM)
        return self.tasks[int(rng.choice(len(self.tasks), p=self.chances))]

    def example(self, index: int) -> Example:
        """Example ``index``; with depth bands, the ``i``-th of its task in turn (``index // len(tasks)``) has
        its needle in band ``i mod --depth-bands``."""
        band = index // len(self.tasks) % self.settings.depth_bands if self.settings.depth_bands else 0
        return draw(self.task_of(index), self.settings, self.alphabet, self.length,
                    generator(self.seed, self.split, self.length, self.offset + index), band)

    def __getitem__(self, index):
        return self.item(index, self.example(index))

    def item(self, index: int, example: Example):
        """The model's input and targets of ``example``, drawn as example ``index``."""
        target = np.full(self.length, self.pad, dtype=np.int64)
        target[example.answers] = example.tokens[example.answers + 1]
        return {"id": index, "source": torch.from_numpy(example.tokens[:-1].copy()),
                "target": torch.from_numpy(target)}

    def __len__(self):
        return self.count

    def num_tokens(self, index):
        return self.length

    def size(self, index):
        return self.length

    @property
    def sizes(self):
        return np.full(self.count, self.length, dtype=np.int64)

    def collater(self, samples):
        if not samples:
            return {}
        source = torch.stack([s["source"] for s in samples])
        target = torch.stack([s["target"] for s in samples])
        return {"id": torch.tensor([s["id"] for s in samples]), "nsentences": len(samples),
                "ntokens": int(target.ne(self.pad).sum()),
                "net_input": {"src_tokens": source, "src_lengths": torch.full((len(samples),), self.length)},
                "target": target, "answers_only": True}

    def ordered_indices(self):
        return np.arange(self.count)

    @property
    def can_reuse_epoch_itr_across_epochs(self):
        return self.split != "train"

    def set_epoch(self, epoch):
        if self.split == "train":  # each epoch new examples
            self.offset = (epoch - 1) * self.count


@register_task(NAME, dataclass=RetrievalConfig)
class RetrievalTask(FairseqTask):
    """The retrieval tasks as language modelling (see the module)."""

    def __init__(self, cfg: RetrievalConfig):
        super().__init__(cfg)
        self.settings = settings_of(cfg)
        self.task_names = task_names(cfg.retrieval_tasks)
        self.dictionary = Dictionary()
        for symbol in self.settings.symbols():
            self.dictionary.add_symbol(symbol)
        self.alphabet = Alphabet.of(self.settings, self.dictionary.nspecial)
        check_lengths(self.settings, self.task_names, [cfg.tokens_per_sample], "--tokens-per-sample")
        if min(cfg.train_examples, cfg.valid_examples) < 1:
            raise UsageError("--train-examples and --valid-examples must be 1 or more")
        if cfg.data:
            raise UsageError(f"the retrieval task reads no data directory ({cfg.data} given): its examples are drawn "
                             "from --retrieval-seed; leave the directory out")

    @classmethod
    def setup_task(cls, cfg: RetrievalConfig, **kwargs):
        return cls(cfg)

    def examples(self, split: str, length: Optional[int] = None, tasks: Optional[List[str]] = None) -> RetrievalDataset:
        """The examples of ``split`` at ``length`` (default: ``--tokens-per-sample``) of ``tasks`` (default:
        ``--retrieval-tasks``): ``--train-examples`` in all for train, ``--valid-examples`` of each task else."""
        if split not in SPLITS:
            raise UsageError(f"the retrieval task has the splits {', '.join(SPLITS)}, not {split!r}")
        tasks = tasks or self.task_names
        size = self.cfg.train_examples if split == "train" else self.cfg.valid_examples * len(tasks)
        return RetrievalDataset(tasks, self.settings, self.alphabet, self.dictionary.pad(), self.cfg.retrieval_seed,
                                split, length or self.cfg.tokens_per_sample, size,
                                self.cfg.train_task_mix if split == "train" else "turns")

    def description(self, split: str) -> dict:
        """What draws the examples of ``split``, whatever their length: answers of two evaluations pair only
        where it is the same."""
        return {"split": split, "seed": self.cfg.retrieval_seed, "examples": self.cfg.valid_examples,
                "settings": asdict(self.settings)}

    def load_dataset(self, split, epoch=1, combine=False, **kwargs):
        self.datasets[split] = self.examples(split)
        self.datasets[split].set_epoch(epoch)

    def eval_lm_dataloader(self, dataset, max_tokens: Optional[int] = None, batch_size: Optional[int] = None,
                           max_positions: Optional[int] = None, num_shards: int = 1, shard_id: int = 0,
                           num_workers: int = 1, data_buffer_size: int = 10, context_window: int = 0):
        """fairseq-eval-lm's batches: every example whole, in order (it asks language-modelling tasks alone)."""
        if context_window > 0:
            raise UsageError("--context-window scores a token stream; the retrieval task's examples stand alone: "
                             "leave it at 0")
        return self.get_batch_iterator(dataset=dataset, max_tokens=max_tokens, max_sentences=batch_size,
                                       max_positions=max_positions, ignore_invalid_inputs=True, num_shards=num_shards,
                                       shard_id=shard_id, num_workers=num_workers,
                                       data_buffer_size=data_buffer_size).next_epoch_itr(shuffle=False)

    def has_sharded_data(self, split):
        return False

    def max_positions(self):
        return self.cfg.tokens_per_sample

    @property
    def source_dictionary(self):
        return self.dictionary

    @property
    def target_dictionary(self):
        return self.dictionary


def settings_of(cfg) -> Settings:
    """The sequences' settings of a task configuration, checked (one line for the first problem)."""
    settings = Settings(cfg.retrieval_vocabulary, cfg.filler_vocabulary, cfg.mqar_pairs, cfg.mqar_queries,
                        cfg.passkey_digits, cfg.passkey_depth, cfg.depth_bands)
    problems = settings.problems()
    if problems:
        raise UsageError(problems[0])
    return settings


def check_lengths(settings: Settings, names: List[str], lengths: List[int], what: str) -> None:
    """One line for the first of ``lengths`` too short for an example of one of the tasks ``names``."""
    for length in lengths:
        for name in names:
            if length < settings.shortest(name):
                raise UsageError(f"{what} {length} is too short for {name}: it needs {settings.shortest(name)} or "
                                 "more with these settings")


def task_names(text: str) -> List[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in TASKS]
    if not names or unknown:
        raise UsageError(f"--retrieval-tasks {text!r}: choose among {', '.join(TASKS)}, comma-separated")
    if len(set(names)) != len(names):
        raise UsageError(f"--retrieval-tasks {text!r} names a task twice")
    return names


def install_answer_scoring() -> None:
    """fairseq's ``SequenceScorer`` (``fairseq-eval-lm``'s) scores a target's first ``n`` positions, ``n`` its
    tokens that are not padding: right where padding only ends a target, wrong for the retrieval tasks, whose
    answers come after padding (and MQAR's between it). A batch of the retrieval task (marked
    ``answers_only``) is scored whole and each row's answers kept; any other batch is scored as fairseq
    scores it."""
    from fairseq.sequence_scorer import SequenceScorer

    stock = SequenceScorer.generate
    if getattr(stock, "kerple_fairseq", False):
        return

    @torch.no_grad()
    def generate(self, models, sample, **kwargs):
        if not sample.get("answers_only"):
            return stock(self, models, sample, **kwargs)
        target = sample["target"]
        answers = target.ne(self.pad)
        # every position a target (the input's tokens, never padding, stand in for the others)
        whole = dict(sample, target=torch.where(answers, target, sample["net_input"]["src_tokens"]))
        hypos = stock(self, models, whole, **kwargs)
        for (hypo,), row, kept in zip(hypos, target, answers):
            scores = hypo["positional_scores"][kept]
            hypo.update(tokens=row[kept], positional_scores=scores, score=scores.sum() / scores.numel())
        return hypos

    generate.kerple_fairseq = True
    SequenceScorer.generate = generate
