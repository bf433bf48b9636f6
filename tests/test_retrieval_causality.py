"""The retrieval path is causal for every encoding: a model's scores of the answers at positions up to t are
the same when any token after t changes, at the training length and beyond it (where the evaluation-time
scalings act). Every position encoding of the comparisons (evaluation-time methods set in the model), every
other kernel and layer bias, and learned positions, on the retrieval task's dictionary, each model's
parameters moved away from their initial values."""

import pytest
import torch

from helpers import TINY, every_encoding, moved
from kerple_fairseq.evaluation import retrieval_accuracy
from kerple_fairseq.experiments.language_models import build_model, parse_model_flags
from kerple_fairseq.tasks.retrieval import RetrievalConfig, RetrievalTask
from kerple_fairseq.tasks.retrieval_sequences import TASKS

TRAIN_LENGTH = 32
ENCODINGS = every_encoding()


@pytest.fixture(scope="module")
def task():
    return RetrievalTask(RetrievalConfig(tokens_per_sample=TRAIN_LENGTH, valid_examples=2))


def answer_log_probs(model, source, target):
    return model.get_normalized_probs(model(source), log_probs=True, sample={"target": target}).float()


@pytest.mark.parametrize("name", ENCODINGS)
def test_answers_up_to_t_ignore_every_token_after_t(task, name):
    torch.manual_seed(0)
    model = moved(build_model(parse_model_flags([*ENCODINGS[name], *TINY]), task))
    lengths = [TRAIN_LENGTH] if name == "learned_pos" else [TRAIN_LENGTH, 4 * TRAIN_LENGTH]
    content = torch.arange(task.alphabet.markers, len(task.dictionary))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for length in lengths:
            dataset = task.examples("valid", length, list(TASKS))
            batch = dataset.collater([dataset[i] for i in range(len(dataset))])
            source, target = batch["net_input"]["src_tokens"], batch["target"]
            before = answer_log_probs(model, source, target)
            answers = target.ne(dataset.pad)
            # what is checked here is what the accuracy reads
            found = retrieval_accuracy.score(model, dataset, torch.device("cpu"), 10 ** 6)
            scored = before.gather(-1, target.unsqueeze(-1)).squeeze(-1)[answers].double().numpy()
            assert found.log_prob.size == answers.sum() and abs(found.log_prob - scored).max() < 1e-6
            for t in (0, length // 3, length - 2):  # the first position, one inside, and the last but one
                changed = source.clone()
                later = changed[:, t + 1:]
                later.copy_(content[torch.randint(len(content), later.shape, generator=g)])
                assert not torch.equal(changed, source)
                after = answer_log_probs(model, changed, target)
                torch.testing.assert_close(after[:, :t + 1], before[:, :t + 1], rtol=0, atol=1e-5,
                                           msg=lambda m: f"{name} at length {length}, t={t}: {m}")
