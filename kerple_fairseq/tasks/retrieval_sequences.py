"""The sequences of the retrieval tasks, each drawn from a seed alone, so that the same seed gives the same
examples on any machine (NumPy's PCG64 seeded by a ``SeedSequence`` of integers).

An example of length ``L`` is ``L + 1`` tokens: a model reads the first ``L`` and predicts the last ``L``.
Only its answers are scored: each is a token the model can know only by finding where it appeared
before, its *source*; an answer's *depth* is how far back that is (its position minus its source's).

- **mqar**, multi-query associative recall (Arora et al. 2023, "Zoology", section 3.1): ``pairs`` distinct
  keys each followed by a value, noise around them, then ``queries`` of those keys, each followed by its
  value; the values are scored.
- **passkey** (Mohtashami and Jaggi 2023, "Landmark attention", section 4.1; the test of YaRN and LongLoRA):
  noise, a marker and ``passkey_digits`` random digits at a depth in it, and at the end the marker again;
  the digits after it are scored.
- **copy** (Jelassi et al. 2024, "Repeat after me", section 3): a random sequence filling half the
  example, a separator and the sequence again, which is scored.

Noise is drawn from a filler alphabet of its own, so it is never a key, a digit or a copied symbol.

The *needle* of MQAR (its key-value pairs) and of the passkey (its marker and digits) lies after a share of
the noise drawn uniformly, or, with ``depth_bands`` B, in the band ``i mod B`` of B equal bands of where it
can be, for the ``i``-th example of its task: band 0 the start of the input, B - 1 next to the question (the
depth of needle-in-a-haystack tests, Kamradt 2023; the map of ``kerple-eval-lm`` reports accuracy by band).

A *whole answer* is what the literature scores as one: an MQAR value, the passkey's digits together, a span
of :data:`COPY_SPAN` copied tokens (copying's last, shorter span is scored token by token alone).
"""

from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import numpy as np

TASKS = ("mqar", "passkey", "copy")
SPLITS = ("train", "valid", "test")
DIGITS = 10

#: the symbols after fairseq's four special ones, in the dictionary's order: a marker opening each task's
#: examples, the passkey's marker and the copy's separator; then the content, the digits and the filler
MARKERS = tuple(f"<{task}>" for task in TASKS) + ("<passkey-marker>", "<copy-separator>")
#: the copied tokens one whole answer of copying holds
COPY_SPAN = 8


@dataclass(frozen=True)
class Settings:
    """What the examples are drawn from; ``vocabulary`` and ``filler`` fix the dictionary, the rest may
    change between training and evaluation."""

    vocabulary: int = 64  # content symbols: MQAR's keys (the first half) and values (the second), copy's symbols
    filler: int = 16  # the noise's symbols
    pairs: int = 8  # MQAR's key-value pairs
    queries: int = 4  # MQAR's queries, of distinct keys among them
    passkey_digits: int = 5
    passkey_depth: Optional[float] = None  # the share of the noise before the passkey; None: drawn uniformly
    depth_bands: int = 0  # > 0: each needle in its band of this many (the module's docstring); 0: drawn uniformly

    def problems(self) -> Sequence[str]:
        """What is wrong with the settings, one sentence each (nothing when they hold)."""
        found = []
        if self.vocabulary < 2 or self.vocabulary % 2:
            found.append(f"--retrieval-vocabulary must be even and 2 or more (half keys, half values), got {self.vocabulary}")
        if self.filler < 1:
            found.append(f"--filler-vocabulary must be 1 or more, got {self.filler}")
        if not 1 <= self.pairs <= self.vocabulary // 2:
            found.append(f"--mqar-pairs must be between 1 and half --retrieval-vocabulary ({self.vocabulary // 2}): "
                         f"keys are distinct, got {self.pairs}")
        if not 1 <= self.queries <= self.pairs:
            found.append(f"--mqar-queries must be between 1 and --mqar-pairs ({self.pairs}), got {self.queries}")
        if self.passkey_digits < 1:
            found.append(f"--passkey-digits must be 1 or more, got {self.passkey_digits}")
        if self.passkey_depth is not None and not 0.0 <= self.passkey_depth <= 1.0:
            found.append(f"--passkey-depth must be between 0 (first) and 1 (last), got {self.passkey_depth}")
        if self.depth_bands < 0:
            found.append(f"--depth-bands must be 0 (needles drawn uniformly) or more, got {self.depth_bands}")
        if self.depth_bands and self.passkey_depth is not None:
            found.append("--passkey-depth and --depth-bands both place the passkey: give one of them")
        return found

    def answers(self, task: str, length: int) -> int:
        """How many answers an example of ``task`` of ``length`` holds."""
        return {"mqar": self.queries, "passkey": self.passkey_digits, "copy": (length - 1) // 2}[task]

    def shortest(self, task: str) -> int:
        """The shortest length an example of ``task`` fits in (with room for a needle in every depth band)."""
        room = max(self.depth_bands - 1, 0)
        return {"mqar": 2 * (self.pairs + self.queries) + room, "passkey": 2 * (self.passkey_digits + 1) + room,
                "copy": 3}[task]

    def needle_offset(self, noise: int, band: int, rng: np.random.Generator) -> int:
        """The noise tokens before a needle, of ``noise + 1`` places: drawn uniformly among all of them, or among
        those of depth band ``band`` (places ``p`` with ``p * depth_bands // (noise + 1) == band``)."""
        if not self.depth_bands:
            return int(rng.integers(0, noise + 1))
        first = -(-band * (noise + 1) // self.depth_bands)
        return int(rng.integers(first, -(-(band + 1) * (noise + 1) // self.depth_bands)))

    def symbols(self):
        """The dictionary's symbols after fairseq's four special ones (:data:`MARKERS`, content, digits, filler)."""
        return [*MARKERS, *(f"c{i}" for i in range(self.vocabulary)), *(f"d{i}" for i in range(DIGITS)),
                *(f"f{i}" for i in range(self.filler))]


class Example(NamedTuple):
    tokens: np.ndarray  # L + 1 symbol indices (of :meth:`Settings.symbols`, offset by the dictionary)
    answers: np.ndarray  # the positions of the scored targets: target t is tokens[t + 1], read after tokens[:t + 1]
    sources: np.ndarray  # for each answer, the position in ``tokens`` of the token it repeats
    band: int = -1  # the depth band its needle was placed in; -1: none (no bands, or copying)


class Alphabet(NamedTuple):
    """Where each kind of symbol starts in the dictionary."""

    markers: int
    content: int
    digits: int
    filler: int

    @classmethod
    def of(cls, settings: Settings, first: int) -> "Alphabet":
        content = first + len(MARKERS)
        digits = content + settings.vocabulary
        return cls(first, content, digits, digits + DIGITS)


def generator(seed: int, split: str, length: int, index: int, *more: int) -> np.random.Generator:
    """The random numbers of one example (``more``: another stream of it): the same for the same numbers on any
    machine."""
    return np.random.default_rng([seed, SPLITS.index(split), length, index, *more])


def draw(task: str, settings: Settings, alphabet: Alphabet, length: int, rng: np.random.Generator,
         band: int = 0) -> Example:
    """One example of ``task`` of ``length`` (at least ``settings.shortest(task)``), its needle in depth band
    ``band`` where ``settings.depth_bands`` places needles."""
    if settings.depth_bands and not 0 <= band < settings.depth_bands:
        raise ValueError(f"depth band {band} is not one of the {settings.depth_bands}")
    banded = band if settings.depth_bands else -1
    tokens = np.empty(length + 1, dtype=np.int64)
    tokens[0] = alphabet.markers + TASKS.index(task)
    if task == "mqar":
        pairs, queries = settings.pairs, settings.queries
        noise = length - 2 * (pairs + queries)
        before = settings.needle_offset(noise, band, rng)
        keys = alphabet.content + rng.choice(settings.vocabulary // 2, pairs, replace=False)
        values = alphabet.content + settings.vocabulary // 2 + rng.integers(0, settings.vocabulary // 2, pairs)
        start = 1 + before
        tokens[1:start] = alphabet.filler + rng.integers(0, settings.filler, before)
        tokens[start:start + 2 * pairs:2], tokens[start + 1:start + 2 * pairs:2] = keys, values
        end = start + 2 * pairs + noise - before
        tokens[start + 2 * pairs:end] = alphabet.filler + rng.integers(0, settings.filler, noise - before)
        asked = rng.choice(pairs, queries, replace=False)
        tokens[end::2], tokens[end + 1::2] = keys[asked], values[asked]
        return Example(tokens, end + 2 * np.arange(queries), start + 2 * asked + 1, banded)
    if task == "passkey":
        digits = settings.passkey_digits
        noise = length - 2 * (digits + 1)
        if settings.depth_bands:
            before = settings.needle_offset(noise, band, rng)
        else:
            depth = rng.uniform() if settings.passkey_depth is None else settings.passkey_depth
            before = int(round(depth * noise))
        passkey = alphabet.digits + rng.integers(0, DIGITS, digits)
        marker = alphabet.markers + len(TASKS)
        tokens[1:-digits - 1] = alphabet.filler + rng.integers(0, settings.filler, length - digits - 1)
        tokens[1 + before] = tokens[-digits - 1] = marker
        tokens[2 + before:2 + before + digits] = tokens[-digits:] = passkey
        return Example(tokens, np.arange(length - digits, length), 2 + before + np.arange(digits), banded)
    if task == "copy":
        half = (length - 1) // 2
        offset = length - 1 - 2 * half  # one filler token after the marker when the length is even
        tokens[1:1 + offset] = alphabet.filler + rng.integers(0, settings.filler, offset)
        sequence = alphabet.content + rng.integers(0, settings.vocabulary, half)
        first = 1 + offset
        tokens[first:first + half] = tokens[-half:] = sequence
        tokens[first + half] = alphabet.markers + len(TASKS) + 1
        return Example(tokens, np.arange(length - half, length), first + np.arange(half))
    raise ValueError(f"unknown retrieval task {task!r}: choose among {', '.join(TASKS)}")


def whole_answers(task: str, count: int) -> np.ndarray:
    """For each of the ``count`` answers of an example of ``task``, the whole answer it is part of (0, 1, ..
    in the example), or -1 for none."""
    if task == "mqar":
        return np.arange(count)
    if task == "passkey":
        return np.zeros(count, dtype=np.int64)
    if task == "copy":
        spans = np.arange(count) // COPY_SPAN
        spans[count - count % COPY_SPAN:] = -1
        return spans
    raise ValueError(f"unknown retrieval task {task!r}: choose among {', '.join(TASKS)}")


def answer_symbols(task: str, settings: Settings, alphabet: Alphabet) -> range:
    """The symbols an answer of ``task`` is drawn from: MQAR's values, the digits, the copied content."""
    values = alphabet.content + settings.vocabulary // 2
    return {"mqar": range(values, alphabet.digits), "passkey": range(alphabet.digits, alphabet.filler),
            "copy": range(alphabet.content, alphabet.digits)}[task]


def shown_answer_symbols(task: str, settings: Settings, alphabet: Alphabet, example: Example) -> int:
    """How many distinct symbols of :func:`answer_symbols` the input shows before the first answer: those a
    model that guesses among the candidates in its context picks from (MQAR's values in the pairs, the
    passkey's digits, the copied sequence's symbols)."""
    symbols = answer_symbols(task, settings, alphabet)
    read = example.tokens[:example.answers[0] + 1]
    return int(np.unique(read[(read >= symbols.start) & (read < symbols.stop)]).size)
