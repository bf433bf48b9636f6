"""The retrieval tasks in one process: the examples drawn from a seed alone and alike on any machine, their
answers found again by rules written from the tasks' descriptions, only the answers scored (by fairseq's
cross_entropy criterion and by the plugin's accuracy), a model that copies perfectly scoring 100% and one
that reads only the current token scoring chance, and the board's statistics against brute force."""

import hashlib
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fairseq.criterions.cross_entropy import CrossEntropyCriterion

from helpers import tiny_model
from kerple_fairseq.analysis import retrieval_board, significance
from kerple_fairseq.errors import UsageError
from kerple_fairseq.evaluation import retrieval_accuracy
from kerple_fairseq.evaluation.retrieval_accuracy import ExampleScores
from kerple_fairseq.tasks.retrieval import NAME, RetrievalConfig, RetrievalTask
from kerple_fairseq.tasks.retrieval_sequences import TASKS, Settings, generator


def retrieval_task(**options):
    return RetrievalTask(RetrievalConfig(**options))


def symbols(task, prefix, count):
    return {task.dictionary.index(f"{prefix}{i}") for i in range(count)}


# --- the answers by rules of their own: what follows from each task's description ------------------------

def expected_answers(task, tokens: np.ndarray):
    """The scored targets (t: tokens[t + 1] read after tokens[:t + 1]) and the token each must be, found by
    reading the example as the task's description says, and the position each repeats."""
    d = task.dictionary
    kind = d[int(tokens[0])].strip("<>")
    if kind == "mqar":
        keys = symbols(task, "c", task.settings.vocabulary // 2)
        seen, found = {}, []
        for t in range(1, len(tokens) - 1):
            token = int(tokens[t])
            if token in keys and token in seen:  # a key asked again: its value follows it the first time
                found.append((t, seen[token] + 1))
            elif token in keys:
                seen[token] = t
        return found
    if kind == "passkey":
        first, second = np.flatnonzero(tokens == d.index("<passkey-marker>"))
        return [(second + k, first + 1 + k) for k in range(task.settings.passkey_digits)]
    separator = int(np.flatnonzero(tokens == d.index("<copy-separator>"))[0])
    content = symbols(task, "c", task.settings.vocabulary)
    start = next(t for t in range(1, separator) if int(tokens[t]) in content)
    return [(separator + k, start + k) for k in range(separator - start)]


@pytest.mark.parametrize("name", TASKS)
@pytest.mark.parametrize("length", [24, 25, 64, 301])
def test_answers_are_what_the_task_describes(name, length):
    task = retrieval_task(retrieval_tasks=name, tokens_per_sample=length, valid_examples=40)
    data = task.examples("valid")
    filler = symbols(task, "f", task.settings.filler)
    for index in range(len(data)):
        example = data.example(index)
        tokens = example.tokens
        assert tokens.shape == (length + 1,)
        found = expected_answers(task, tokens)
        assert example.answers.tolist() == [t for t, _ in found]
        assert example.sources.tolist() == [s for _, s in found]
        assert (tokens[example.answers + 1] == tokens[example.sources]).all()
        assert all(int(tokens[t + 1]) not in filler for t in example.answers)
        item = data[index]
        assert torch.equal(item["source"], torch.from_numpy(tokens[:-1]))
        scored = item["target"].ne(task.dictionary.pad())
        assert scored.nonzero().squeeze(1).tolist() == example.answers.tolist()
        assert torch.equal(item["target"][scored], torch.from_numpy(tokens[example.answers + 1]))
        if name == "mqar":
            keys = tokens[example.sources - 1]
            assert len(set(keys.tolist())) == task.settings.queries


def test_the_same_seed_gives_the_same_examples_on_any_machine():
    """The first examples of every split and task, by their sha256: NumPy's PCG64 from a SeedSequence of
    integers gives the same numbers on every platform, and so these digests."""
    digest = hashlib.sha256()
    for split in ("train", "valid", "test"):
        for name in TASKS:
            data = retrieval_task(retrieval_tasks=name, tokens_per_sample=40).examples(split)
            for index in range(5):
                digest.update(data.example(index).tokens.astype("<i8").tobytes())
    assert digest.hexdigest() == EXAMPLES_DIGEST
    first, again = (retrieval_task(tokens_per_sample=40).examples("valid") for _ in range(2))
    other_seed = retrieval_task(tokens_per_sample=40, retrieval_seed=2).examples("valid")
    assert np.array_equal(first.example(7).tokens, again.example(7).tokens)
    assert not np.array_equal(first.example(7).tokens, other_seed.example(7).tokens)
    assert not np.array_equal(first.example(7).tokens, first.example(10).tokens)


EXAMPLES_DIGEST = "2d84b1c42245ead89bce685765151186d6024237269d7b0037da4b5b6240e6d7"


def test_passkey_depth_places_the_passkey():
    for depth, where in ((0.0, 1), (1.0, 64 - 2 * 6 + 1)):
        data = retrieval_task(retrieval_tasks="passkey", tokens_per_sample=64, passkey_depth=depth).examples("valid")
        example = data.example(3)
        assert example.sources[0] - 1 == where  # the marker's position
    drawn = retrieval_task(retrieval_tasks="passkey", tokens_per_sample=256).examples("valid")
    depths = [drawn.example(i).answers[0] + 1 - drawn.example(i).sources[0] for i in range(len(drawn))]
    assert min(depths) < 80 and max(depths) > 180  # drawn over the whole example


@pytest.mark.parametrize("length", [64, 256])
def test_depth_bands_place_each_tasks_needles_in_turn(length):
    """With ``--depth-bands 5`` the i-th example of each task has its needle (found from its tokens: the noise
    before the first key, or before the passkey's marker) in the fifth ``i mod 5`` of the places it can be,
    and the bands' places cover them all, each place drawn."""
    bands, task = 5, retrieval_task(retrieval_tasks="mqar,passkey,copy", tokens_per_sample=length, depth_bands=5,
                                    valid_examples=400)
    data, alphabet = task.examples("valid"), task.alphabet
    seen = {"mqar": set(), "passkey": set()}
    for index in range(len(data)):
        name, example = TASKS[index % 3], data.example(index)
        if name == "copy":
            assert example.band == -1
            continue
        noise = length - (2 * (8 + 4) if name == "mqar" else 2 * (5 + 1))
        body = example.tokens[1:]
        before = int(np.argmax((body < alphabet.filler) if name == "mqar" else (body == alphabet.markers + 3)))
        assert example.band == index // 3 % bands == before * bands // (noise + 1)
        seen[name].add(before)
    if length == 64:  # 134 examples each over 41 and 53 places
        assert seen == {"mqar": set(range(41)), "passkey": set(range(53))}
    uniform = retrieval_task(retrieval_tasks="mqar,passkey", tokens_per_sample=length).examples("valid")
    assert {uniform.example(i).band for i in range(6)} == {-1}


def test_depth_bands_need_room_and_exclude_a_fixed_passkey_depth():
    with pytest.raises(UsageError, match="too short for mqar: it needs 28 or more"):
        retrieval_task(tokens_per_sample=27, depth_bands=5)
    retrieval_task(tokens_per_sample=28, depth_bands=5)  # 28: 5 places of noise, one a band
    with pytest.raises(UsageError, match="--passkey-depth and --depth-bands both place the passkey"):
        retrieval_task(passkey_depth=0.5, depth_bands=5)


def batches(task, split, epoch):
    iterator = task.get_batch_iterator(task.dataset(split), max_sentences=4, epoch=epoch)
    return iterator, [b["net_input"]["src_tokens"] for b in iterator.next_epoch_itr(shuffle=False)]


def test_training_examples_change_with_the_epoch_and_validation_examples_do_not():
    """Through fairseq's batch iterator, as fairseq-train reads them."""
    task = retrieval_task(train_examples=12, valid_examples=4)
    for split in ("train", "valid"):
        task.load_dataset(split)
    _, first = batches(task, "train", 1)
    _, second = batches(task, "train", 2)
    assert len(first) == len(second) == 3 and not any(torch.equal(a, b) for a, b in zip(first, second))
    _, again = batches(task, "train", 1)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    valid, valid_batches = batches(task, "valid", 1)
    valid_again, valid_later = batches(task, "valid", 2)
    assert valid_again is valid and all(torch.equal(a, b) for a, b in zip(valid_batches, valid_later))


def test_an_equal_loss_mix_gives_every_task_as_many_answers():
    """Under ``--train-task-mix equal-loss`` each training example's task is drawn with a chance inverse to its
    answers (4, 5 and 31 at length 64): the answers of each task are a third of all, within four standard
    errors; the draw is the same on a second reading and new with the epoch; valid and test stay in turn."""
    task = retrieval_task(train_examples=6000, train_task_mix="equal-loss")
    train = task.examples("train")
    drawn = [train.task_of(i) for i in range(len(train))]
    answers = {name: task.settings.answers(name, 64) for name in TASKS}
    assert answers == {"mqar": 4, "passkey": 5, "copy": 31}
    assert all(len(train.example(i).answers) == answers[drawn[i]] for i in range(0, 6000, 97))
    chances = np.array([1 / 4, 1 / 5, 1 / 31]) / sum([1 / 4, 1 / 5, 1 / 31])
    for name, p in zip(TASKS, chances):
        count = drawn.count(name)
        assert abs(count - 6000 * p) < 4 * math.sqrt(6000 * p * (1 - p)), (name, count, 6000 * p)
    assert drawn == [task.examples("train").task_of(i) for i in range(len(train))]
    train.set_epoch(2)
    assert drawn != [train.task_of(i) for i in range(len(train))]
    valid = task.examples("valid")
    assert [valid.task_of(i) for i in range(6)] == [*TASKS, *TASKS]
    turns = retrieval_task(train_examples=6).examples("train")
    assert [turns.task_of(i) for i in range(6)] == [*TASKS, *TASKS]


@pytest.mark.parametrize("options, message", [
    ({"retrieval_tasks": "mqar,recall"}, "choose among mqar, passkey, copy"),
    ({"retrieval_tasks": "copy,copy"}, "names a task twice"),
    ({"retrieval_vocabulary": 7}, "--retrieval-vocabulary must be even"),
    ({"filler_vocabulary": 0}, "--filler-vocabulary must be 1 or more"),
    ({"mqar_pairs": 40}, "--mqar-pairs must be between 1 and half"),
    ({"mqar_queries": 9}, "--mqar-queries must be between 1 and --mqar-pairs (8)"),
    ({"passkey_digits": 0}, "--passkey-digits must be 1 or more"),
    ({"passkey_depth": 1.5}, "--passkey-depth must be between 0 (first) and 1 (last)"),
    ({"depth_bands": -1}, "--depth-bands must be 0 (needles drawn uniformly) or more"),
    ({"tokens_per_sample": 20}, "--tokens-per-sample 20 is too short for mqar: it needs 24 or more"),
    ({"valid_examples": 0}, "--valid-examples must be 1 or more"),
])
def test_bad_options_are_one_line_each(options, message):
    with pytest.raises(UsageError) as e:
        retrieval_task(**options)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_an_unknown_split_is_refused():
    with pytest.raises(UsageError, match="splits train, valid, test, not 'dev'"):
        retrieval_task().load_dataset("dev")


# --- scoring the answers only ------------------------------------------------------------------------------

class ByRule(torch.nn.Module):
    """A model whose most probable next token at each position is ``predict(row)[t]``: a stand-in for a
    trained model with known behaviour."""

    def __init__(self, vocabulary: int, predict):
        super().__init__()
        self.vocabulary, self.predict = vocabulary, predict
        self.anchor = torch.nn.Parameter(torch.zeros(()))  # a device to be on

    def forward(self, source):
        logits = torch.zeros(*source.shape, self.vocabulary)
        for b, row in enumerate(source.numpy()):
            logits[b, torch.arange(source.size(1)), torch.as_tensor(self.predict(row))] = 8.0
        return logits, {}

    def get_normalized_probs(self, output, log_probs, sample=None):
        return F.log_softmax(output[0], dim=-1)


def copying(task):
    """Predicts every answer from where the task's description says it is (the rules above)."""
    def predict(row):
        out = np.full(len(row), task.dictionary.pad())
        tokens = np.append(row, task.dictionary.pad())  # the last target is not in the input
        for t, source in expected_answers(task, tokens):
            out[t] = row[source]
        return out
    return predict


def current_token_only(task):
    """Predicts from the token it reads alone, always a symbol of the answer's kind: a key gives a value, the
    passkey's marker or a digit gives a digit, anything else a content symbol. Since answers are drawn
    uniformly and apart from the token before them, it is right by chance: 1/32, 1/10, 1/64."""
    d, half = task.dictionary, task.settings.vocabulary // 2
    table = {}
    for i in range(task.settings.vocabulary):
        table[d.index(f"c{i}")] = d.index(f"c{half + (7 * i) % half}") if i < half else d.index(f"c{(5 * i) % (2 * half)}")
    for i in range(10):
        table[d.index(f"d{i}")] = d.index(f"d{(3 * i + 1) % 10}")
    table[d.index("<passkey-marker>")] = d.index("d4")

    def predict(row):
        return np.array([table.get(int(x), d.index("c0")) for x in row])
    return predict


@pytest.mark.parametrize("name, chance", [("mqar", 1 / 32), ("passkey", 1 / 10), ("copy", 1 / 64)])
def test_a_perfect_copier_scores_everything_and_one_that_never_attends_scores_chance(name, chance):
    task = retrieval_task(retrieval_tasks=name, tokens_per_sample=64, valid_examples=600)
    data = task.examples("valid")
    perfect = retrieval_accuracy.score(ByRule(len(task.dictionary), copying(task)), data, "cpu", 4096)
    assert perfect.correct.all() and perfect.correct.size == sum(len(data.example(i).answers) for i in range(len(data)))
    blind = retrieval_accuracy.score(ByRule(len(task.dictionary), current_token_only(task)), data, "cpu", 4096)
    n = blind.correct.size
    assert abs(blind.correct.mean() - chance) < 4 * math.sqrt(chance * (1 - chance) / n), (blind.correct.mean(), n)


def sometimes_right(task):
    """Predicts as :func:`copying`, but wrong wherever ``(7 t + 3 row[t]) % 9 == 0``: whole answers right and
    wrong by a rule of its own."""
    right = copying(task)

    def predict(row):
        out = right(row)
        wrong = (7 * np.arange(len(row)) + 3 * row) % 9 == 0
        out[wrong] = task.dictionary.pad()
        return out
    return predict


def wholes_by_description(task, tokens):
    """The whole answers of an example as the task's description says (an MQAR value, the passkey's digits
    together, copying's spans of 8 tokens, its last shorter span none): lists of answer positions."""
    answers = [t for t, _ in expected_answers(task, tokens)]
    kind = task.dictionary[int(tokens[0])].strip("<>")
    if kind == "mqar":
        return [[t] for t in answers]
    if kind == "passkey":
        return [answers]
    return [answers[k:k + 8] for k in range(0, len(answers) - 7, 8)]


@pytest.mark.parametrize("name", TASKS)
@pytest.mark.parametrize("length", [24, 64, 301])
def test_whole_answers_are_right_when_every_token_is(name, length):
    task = retrieval_task(retrieval_tasks=name, tokens_per_sample=length, valid_examples=40)
    data = task.examples("valid")
    predict = sometimes_right(task)
    found = retrieval_accuracy.score(ByRule(len(task.dictionary), predict), data, "cpu", 4096)
    right, depths = [], []
    for i in range(len(data)):
        tokens = data.example(i).tokens
        predicted = predict(tokens[:-1])
        sources = dict(expected_answers(task, tokens))
        for whole in wholes_by_description(task, tokens):
            right.append(all(predicted[t] == tokens[t + 1] for t in whole))
            depths.append(max(t + 1 - sources[t] for t in whole))
    record = retrieval_accuracy.summary(name, length, found, 64)
    assert record["num_whole"] == len(right) > 0 and record["whole_accuracy"] == np.mean(right)
    assert 0 < np.mean(found.correct) < 1 and 0 < np.mean(right) < 1
    for d in record["depths"]:
        inside = [r for r, depth in zip(right, depths) if d["from"] <= depth <= d["to"]]
        assert d["num_whole"] == len(inside) and d["whole_accuracy"] == (np.mean(inside) if inside else None)


def expected_inverse_power(draws: int, symbols: int, k: int) -> float:
    """E[D^-k], D the distinct symbols among ``draws`` drawn uniformly from ``symbols`` (exact, in
    float64): P(D = d) = C(symbols, d) S(draws, d) d! / symbols^draws, S Stirling's numbers of the second kind."""
    stirling = [[0] * (draws + 1) for _ in range(draws + 1)]
    stirling[0][0] = 1
    for n in range(1, draws + 1):
        for d in range(1, n + 1):
            stirling[n][d] = d * stirling[n - 1][d] + stirling[n - 1][d - 1]
    return sum(math.comb(symbols, d) * stirling[draws][d] * math.factorial(d) / symbols ** draws / d ** k
               for d in range(1, draws + 1))


@pytest.mark.parametrize("name, draws, symbols, span", [("mqar", 8, 32, 1), ("passkey", 5, 10, 5), ("copy", 31, 64, 8)])
def test_chance_levels_are_the_expected_guesses(name, draws, symbols, span):
    """At length 64: a guess among every answer symbol is right 1/symbols a token; a guess among those the
    input shows (MQAR's 8 values, the passkey's 5 digits, copying's 31 symbols, each drawn uniformly, so D of
    them distinct) is right E[1/D] a token and E[D^-span] a whole answer, within four standard errors."""
    examples = 1500
    task = retrieval_task(retrieval_tasks=name, tokens_per_sample=64, valid_examples=examples)
    found = retrieval_accuracy.score(ByRule(len(task.dictionary), current_token_only(task)), task.examples("valid"),
                                     "cpu", 1 << 16)
    chance = retrieval_accuracy.summary(name, 64, found, 64)["chance"]
    assert chance["per_token"]["uniform"] == pytest.approx(1 / symbols)
    assert chance["whole"]["uniform"] == pytest.approx(symbols ** -span)
    for key, k in (("per_token", 1), ("whole", span)):
        mean, second = expected_inverse_power(draws, symbols, k), expected_inverse_power(draws, symbols, 2 * k)
        error = math.sqrt((second - mean ** 2) / examples)
        assert abs(chance[key]["in_context"] - mean) < 4 * error, (key, chance[key]["in_context"], mean, error)


def test_cross_entropy_and_the_accuracy_read_the_answers_alone():
    """fairseq's cross_entropy criterion on a batch equals minus the mean log-probability of its answers, as
    retrieval_accuracy.score finds them; the accuracy is the argmax's, position by position."""
    task = retrieval_task(tokens_per_sample=48, valid_examples=6)
    model = tiny_model("alibi", task=task).eval()
    data = task.examples("valid")
    sample = data.collater([data[i] for i in range(len(data))])
    criterion = CrossEntropyCriterion(task, sentence_avg=False)
    with torch.no_grad():
        loss, sample_size, _ = criterion(model, sample)
        log_probs = F.log_softmax(model(sample["net_input"]["src_tokens"])[0].double(), -1)
    found = retrieval_accuracy.score(model, data, "cpu", 10_000)
    assert sample_size == sample["ntokens"] == found.correct.size
    assert float(loss) / sample_size == pytest.approx(-found.log_prob.mean(), rel=1e-5)
    rows, columns = [], []
    for i in range(len(data)):
        rows += [i] * len(data.example(i).answers)
        columns += data.example(i).answers.tolist()
    targets = sample["target"][rows, columns]
    assert np.array_equal(found.correct, (log_probs[rows, columns].argmax(-1) == targets).numpy())
    assert np.allclose(found.log_prob, log_probs[rows, columns, targets].numpy(), atol=1e-5)


def test_depth_bins_and_summary():
    assert retrieval_accuracy.depth_bins(64, 300) == [(1, 64), (65, 128), (129, 256), (257, 512)]
    M = retrieval_accuracy.MAX_WHOLES  # example 1's first whole answer
    answers = retrieval_accuracy.Answers(np.array([0, 0, 1, 1]), np.array([10, 100, 64, 65]),
                                         np.array([True, False, True, True]), np.log([0.5, 0.25, 1.0, 0.5]),
                                         np.array([0, 1, M, M]), np.full(4, 10), np.array([2, 2, 4, 4]),
                                         np.array([3, 3, 0, 0]))
    record = retrieval_accuracy.summary("mqar", 128, answers, 64)
    assert record["depth_bands"] == [{"band": 0, "accuracy": 1.0, "num_answers": 2, "whole_accuracy": 1.0,
                                      "num_whole": 1},
                                     {"band": 3, "accuracy": 0.5, "num_answers": 2, "whole_accuracy": 0.5,
                                      "num_whole": 2}]
    assert "depth_bands" not in retrieval_accuracy.summary("mqar", 128, answers._replace(band=np.full(4, -1)), 64)
    assert record["accuracy"] == 0.75 and record["num_examples"] == 2
    assert record["whole_accuracy"] == 2 / 3 and record["num_whole"] == 3
    assert record["loss"] == pytest.approx((1 + 2 + 0 + 1) / 4)
    assert record["depths"] == [{"from": 1, "to": 64, "accuracy": 1.0, "num_answers": 2, "whole_accuracy": 1.0,
                                 "num_whole": 1},
                                {"from": 65, "to": 128, "accuracy": 0.5, "num_answers": 2, "whole_accuracy": 0.5,
                                 "num_whole": 2}]
    assert record["chance"] == {"per_token": {"uniform": pytest.approx(0.1), "in_context": pytest.approx(0.375)},
                                "whole": {"uniform": pytest.approx((0.1 + 0.1 + 0.01) / 3),
                                          "in_context": pytest.approx((0.5 + 0.5 + 1 / 16) / 3)}}
    per_example = answers.per_example()
    assert per_example.correct.tolist() == [1, 2] and per_example.answers.tolist() == [2, 2]
    assert per_example.whole_correct.tolist() == [1, 1] and per_example.wholes.tolist() == [2, 1]


def test_example_scores_files_are_data(tmp_path):
    scores = {("mqar", 64): ExampleScores(np.array([3, 4]), np.array([4, 4]), np.array([3, 4]), np.array([4, 4]))}
    retrieval_accuracy.save(str(tmp_path / "s.npz"), {"seed": 1}, scores)
    meta, read = retrieval_accuracy.load(str(tmp_path / "s.npz"))
    assert meta["seed"] == 1 and np.array_equal(read["mqar", 64].correct, [3, 4])
    np.savez(tmp_path / "other.npz", meta=np.array('{"format": "x"}'))
    with pytest.raises(UsageError, match="not a readable example-scores file"):
        retrieval_accuracy.load(str(tmp_path / "other.npz"))
    np.savez(tmp_path / "objects.npz", meta=np.array([{"format": retrieval_accuracy.FORMAT}], dtype=object))
    with pytest.raises(UsageError, match="not a readable example-scores file"):  # never unpickled
        retrieval_accuracy.load(str(tmp_path / "objects.npz"))
    np.save(tmp_path / "array.npy", np.arange(3))
    with pytest.raises(UsageError, match="not a readable example-scores file"):
        retrieval_accuracy.load(str(tmp_path / "array.npy"))
    np.savez(tmp_path / "list.npz", meta=np.array("[1, 2]"))
    with pytest.raises(UsageError, match="not a readable example-scores file"):
        retrieval_accuracy.load(str(tmp_path / "list.npz"))


# --- the board's statistics -------------------------------------------------------------------------------

def test_accuracy_t_interval_is_the_delete_one_jackknife():
    rng = np.random.default_rng(0)
    counts = rng.integers(1, 6, 30).astype(float)
    correct = np.stack([rng.binomial(counts.astype(int), p) for p in (0.4, 0.6)]).astype(float)
    low, high = significance.jackknife_t_interval(correct, counts, 0.95, significance.identity)
    left_out = [(correct[1].sum() - correct[1][k] - correct[0].sum() + correct[0][k]) / (counts.sum() - counts[k])
                for k in range(30)]
    error = math.sqrt(29 / 30 * sum((x - np.mean(left_out)) ** 2 for x in left_out))
    difference = (correct[1].sum() - correct[0].sum()) / counts.sum()
    t = significance.student_t_quantile(0.975, 29)
    assert (low, high) == pytest.approx((difference - t * error, difference + t * error))
    boot = significance.bootstrap_perplexities(correct, counts, 200, 3, significance.identity)
    weights = np.concatenate(list(significance.resample_weights(30, 200, 3))).astype(float)
    assert np.allclose(boot, weights @ correct.T / (weights @ counts)[:, None])


CHANCE = {"per_token": {"uniform": 0.01, "in_context": 0.02}, "whole": {"uniform": 0.01, "in_context": 0.02}}


def board_of(accuracies, beyond=None, examples=200, seeds=(1, 2), criterion=0.4, references=None):
    """A board from example scores made to give each model ``accuracies[name]`` (by seed) on every example
    pattern, at 64 (the training length) and 128 (``beyond[name]`` there if given): each example has 4 whole
    answers of one token, and the chance of a guess in context is 2%. Each model is compared with ALiBi, or
    with ``references[name]``."""
    rng = np.random.default_rng(5)

    def scores_of(name, seed):
        found = {}
        for n in (64, 128):
            p = (beyond or accuracies)[name][seeds.index(seed)] if n == 128 else accuracies[name][seeds.index(seed)]
            correct = rng.binomial(4, p, examples)
            found["passkey", n] = ExampleScores(correct, np.full(examples, 4), correct, np.full(examples, 4))
        return {"seed": 1}, found

    entrants = [retrieval_board.Entrant(name, name.upper(), "additive bias", list(seeds),
                                        (references or {}).get(name, ["alibi"])) for name in accuracies]
    chance = {("passkey", n): CHANCE for n in (64, 128)}
    return retrieval_board.build(entrants, 64, scores_of, chance, criterion, samples=2000)


def test_board_ranks_the_models_that_learned_the_task_and_resolves():
    board = board_of({"alibi": [0.5, 0.5], "nope": [0.9, 0.9], "t5": [0.5, 0.52], "fire": [0.2, 0.6]})
    assert board.tasks == ["passkey"] and board.lengths == [64, 128] and board.beyond == [128]
    ranks = board.ranks("passkey")
    assert ranks["nope"] == 1 and ranks["alibi"] > 1 and "fire" not in ranks  # fire's first seed did not learn it
    assert [e.name for e in board.in_order("passkey")][0] == "nope" and board.in_order("passkey")[-1].name == "fire"
    verdicts = {v.model: v for v in board.versus if v.length == 128}
    assert verdicts["nope"].verdict == retrieval_board.RESOLVED and board.marked(verdicts["nope"])
    assert verdicts["t5"].verdict != retrieval_board.RESOLVED
    assert retrieval_board.comparison_state(board, verdicts["fire"]) == "not compared: not learned at the training length"
    table = retrieval_board.markdown(board, "passkey", {"nope": 25}, {"nope": "learned at 500"})
    assert "| 1 | NOPE | additive bias |" in table and "▲" in table and "| 25 | learned at 500 |" in table
    assert "| not learned | FIRE |" in table and "| | *guess among the symbols the input shows* | | 2.0 | 2.0 |" in table
    rules = {"fire": "its trained model learned the tasks; evaluated with --x, ...", "nope": "never shown: ranked"}
    with_rules = retrieval_board.markdown(board, "passkey", {}, {"fire": "updates to learn: 500"}, rules)
    assert "| updates to learn: 500; its trained model learned the tasks; evaluated with --x, ... |" in with_rules
    assert "never shown" not in with_rules
    header, rows = retrieval_board.csv_rows(board)
    assert len(rows) == 4 * 2 and header[0] == "model"


def test_board_compares_each_model_with_its_family_baseline_too():
    """YaRN on rotary: level with ALiBi at 128, far above rotary there; its ▲ is in the family-baseline table, not
    in the task's table (whose marks are against ALiBi). FIRE, not learned, is compared with neither."""
    at_64 = {"alibi": [0.9, 0.9], "rotary": [0.9, 0.9], "yarn": [0.9, 0.9], "fire": [0.2, 0.6]}
    at_128 = {"alibi": [0.9, 0.9], "rotary": [0.3, 0.3], "yarn": [0.9, 0.9], "fire": [0.2, 0.6]}
    family = {name: ["alibi", "rotary"] for name in ("rotary", "yarn", "fire")}
    board = board_of(at_64, beyond=at_128, references=family)
    assert {(v.model, v.reference) for v in board.versus} == {
        ("rotary", "alibi"), ("yarn", "alibi"), ("yarn", "rotary"), ("fire", "alibi"), ("fire", "rotary")}
    assert len(board.versus) == 5 * 2
    assert board.baseline_of(board.entrants[2]) == "rotary" and board.baseline_of(board.entrants[1]) is None
    above = board.against("yarn", "passkey", 128, "rotary")
    assert above.difference[0] > 0.5 and board.marked(above)
    assert not board.marked(board.against("yarn", "passkey", 128))
    assert board.marked(board.against("rotary", "passkey", 128)) and board.against("rotary", "passkey", 128, "rotary") is None
    table = retrieval_board.markdown(board, "passkey", {}, {})
    yarn_row = next(line for line in table.splitlines() if "| YARN |" in line)
    assert "▲" not in yarn_row and "▼" not in yarn_row and "▼" in next(
        line for line in table.splitlines() if "| ROTARY |" in line)
    baselines = retrieval_board.baseline_markdown(board, "passkey").splitlines()
    assert baselines[0] == "| model | − family baseline | L=64 | L=128 | not compared |"
    assert [line.split(" | ")[0] for line in baselines[2:]] == ["| YARN", "| FIRE"]  # ALiBi and rotary: no baseline
    assert baselines[2].startswith("| YARN | ROTARY | +") and baselines[2].endswith(" ▲ |  |")
    assert baselines[3] == "| FIRE | ROTARY |  |  | FIRE not learned at L=64 |"
    seeds = retrieval_board.seed_markdown(board, "passkey", 128, {e.name: e.label for e in board.entrants})
    assert "| YARN | ROTARY | 1, 2 | +" in seeds and "| YARN | ALIBI | 1, 2 |" in seeds
    header, rows = retrieval_board.csv_rows(board)
    at_128 = [row for row in rows if row[header.index("length")] == 128]
    assert [(row[0], row[header.index("reference")]) for row in at_128] == [
        ("alibi", ""), ("rotary", "alibi"), ("yarn", "alibi"), ("yarn", "rotary"), ("fire", "alibi"), ("fire", "rotary")]
    assert at_128[-1][header.index("verdict")] == retrieval_board.NOT_LEARNED


def test_a_model_at_other_seeds_than_its_baseline_has_no_common_seed():
    def scores_of(name, seed):
        return {"seed": 1}, {("passkey", 64): ExampleScores(*[np.ones(3)] * 4)}

    entrants = [retrieval_board.Entrant("alibi", "ALIBI", "", [1, 2]), retrieval_board.Entrant("rotary", "ROTARY", "", [1]),
                retrieval_board.Entrant("yarn", "YARN", "", [2], ["alibi", "rotary"])]
    board = retrieval_board.build(entrants, 64, scores_of, {("passkey", 64): CHANCE}, 0.97, samples=100)
    assert board.against("yarn", "passkey", 64, "rotary") is None and board.against("yarn", "passkey", 64)
    assert "| YARN | ROTARY | no common seed |  |" in retrieval_board.baseline_markdown(board, "passkey")


def test_no_verdict_between_two_models_at_chance():
    """Both learned the task at 64; at 128 one guesses (2%, the chance in context) and one is right less often
    than that: a resolved difference, but not a verdict. The board's own at-chance test is by the binomial error
    of the guess: two standard errors of 2% over 800 whole answers is 1 point."""
    board = board_of({"alibi": [1.0, 1.0], "nope": [1.0, 1.0]}, beyond={"alibi": [0.02, 0.02], "nope": [0.0, 0.0]})
    assert board.at_chance("alibi", "passkey", 128) and board.at_chance("nope", "passkey", 128)
    assert not board.at_chance("alibi", "passkey", 64)
    (v,) = [v for v in board.versus if v.length == 128]
    assert v.verdict == retrieval_board.RESOLVED and not board.marked(v)
    assert retrieval_board.comparison_state(board, v) == "not compared: both at chance"
    assert "▼" not in retrieval_board.markdown(board, "passkey", {}, {})
    above = board_of({"alibi": [1.0, 1.0], "nope": [1.0, 1.0]}, beyond={"alibi": [0.1, 0.1], "nope": [0.0, 0.0]})
    (v,) = [v for v in above.versus if v.length == 128]
    assert not above.at_chance("alibi", "passkey", 128) and above.marked(v)


def test_board_refuses_scores_of_other_examples_and_needs_the_training_length():
    def scores_of(name, seed):
        return {"seed": seed if name == "nope" else 1}, {("mqar", 64): ExampleScores(*[np.ones(3)] * 4)}

    entrants = [retrieval_board.Entrant(n, n, "f", [1, 2]) for n in ("alibi", "nope")]
    with pytest.raises(UsageError, match="answered different mqar examples at length 64"):
        retrieval_board.build(entrants, 64, scores_of, {("mqar", 64): CHANCE}, 0.97, samples=100)
    with pytest.raises(UsageError, match="not all evaluated at the training length 32"):
        retrieval_board.build(entrants, 32, scores_of, {("mqar", 64): CHANCE}, 0.97, samples=100)


def test_scores_drawn_before_depth_bands_existed_pair_with_those_after():
    before = {"split": "valid", "seed": 1, "settings": {"vocabulary": 64}}
    after = {"split": "valid", "seed": 1, "settings": {"vocabulary": 64, "depth_bands": 0}}
    assert retrieval_board.examples_drawn(before) == retrieval_board.examples_drawn(after) == after
    assert retrieval_board.examples_drawn({**after, "settings": {"vocabulary": 64, "depth_bands": 5}}) != after

    def scores_of(name, seed):
        return (before if name == "nope" else after), {("mqar", 64): ExampleScores(*[np.ones(3)] * 4)}

    entrants = [retrieval_board.Entrant(n, n, "f", [1]) for n in ("alibi", "nope")]
    retrieval_board.build(entrants, 64, scores_of, {("mqar", 64): CHANCE}, 0.97, samples=100)


def test_examples_are_drawn_from_the_four_numbers_alone():
    assert NAME == "retrieval" and Settings().problems() == []
    numbers = generator(1, "valid", 64, 3).integers(0, 1 << 30, 4)
    assert np.array_equal(numbers, generator(1, "valid", 64, 3).integers(0, 1 << 30, 4))
    for other in (generator(2, "valid", 64, 3), generator(1, "test", 64, 3), generator(1, "valid", 65, 3),
                  generator(1, "valid", 64, 4)):
        assert not np.array_equal(numbers, other.integers(0, 1 << 30, 4))


def test_depth_map_is_one_length_a_row_and_averages_the_seeds():
    entrants = [retrieval_board.Entrant(name, name.upper(), "", [1, 2]) for name in ("alibi", "nope")]

    def record(length, band_0, band_1):  # (whole-answer accuracy, whole answers) in bands 0 and 1
        return {"task": "passkey", "length": length, "depth_bands": [
            {"band": 0, "whole_accuracy": band_0[0], "num_whole": band_0[1]},
            {"band": 1, "whole_accuracy": band_1[0], "num_whole": band_1[1]}]}

    records = {("alibi", 1): [record(64, (1.0, 10), (0.5, 12)), record(128, (0.5, 10), (0.25, 12))],
               ("alibi", 2): [record(64, (0.0, 10), (0.5, 12)), record(128, (0.7, 10), (0.75, 12))],
               ("nope", 1): [record(64, (1.0, 10), (1.0, 12)), record(128, (1.0, 10), (1.0, 12))],
               ("nope", 2): [record(64, (1.0, 10), (0.0, 12)), record(128, (0.0, 10), (0.5, 12))]}
    depth_map = retrieval_board.DepthMap.of("passkey", entrants, records)
    assert depth_map.counts.tolist() == [[10, 12], [10, 12]]
    assert depth_map.widest_interval() == pytest.approx(100 * 1.96 * 0.5 / 10 ** 0.5)
    table = retrieval_board.depth_map_markdown(depth_map, entrants)
    assert retrieval_board.band_names(2) == ["0-50%", "50-100%"]
    assert "**ALIBI**\n\n| length | 0-50% | 50-100% |\n|---|---|---|\n| 64 | 50 | 50 |\n| 128 | 60 | 50 |" in table
    assert "**NOPE**\n\n| length | 0-50% | 50-100% |\n|---|---|---|\n| 64 | 100 | 50 |\n| 128 | 50 | 75 |" in table
    records["nope", 2][1]["depth_bands"][1]["num_whole"] = 11  # other examples
    with pytest.raises(UsageError, match="made with other lengths, bands or examples"):
        retrieval_board.DepthMap.of("passkey", entrants, records)
    records["nope", 2][1]["depth_bands"][1]["num_whole"] = 12
    records["nope", 2][1]["depth_bands"][1]["band"] = 2  # a band missing: the columns would be misnamed
    with pytest.raises(UsageError, match="made with other lengths, bands or examples"):
        retrieval_board.DepthMap.of("passkey", entrants, records)
    records["nope", 2][1]["depth_bands"][1]["band"] = 1
    del records["nope", 2][1]  # a length missing
    with pytest.raises(UsageError, match="made with other lengths, bands or examples"):
        retrieval_board.DepthMap.of("passkey", entrants, records)

