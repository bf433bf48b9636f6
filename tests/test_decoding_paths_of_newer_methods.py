"""FIRE, FoX, chunked attention, DAPE (over no bias, ALiBi, KERPLE-log, a weight kernel, rotary, FIRE and FoX), CoPE
(alone and over ALiBi, KERPLE-log, rotary, FIRE and a weight kernel), stick-breaking, selective
attention, scalable softmax, Llama 4's temperature and ReRoPE on every decoding path:
incremental decoding and beam search equal full scoring, blocks equal one block, a trimmed cache
equals scoring with the window."""

import pytest
import torch

from helpers import tiny_model
from test_attention_rules import CASES as RULE_CASES
from test_cope import CASES as COPE_CASES, cope_model
from test_layer_biases import METHODS, log_probs, method_id, tokens_of
from test_dape import CASES as DAPE_CASES

#: chunked attention (chunks of 8, longer than the trimmed cache's window of 6), alone and with rotary
CHUNKED = [("chunked", ["--attn-chunk-size", "8"]), ("chunked", ["--attn-chunk-size", "8", "--rotary-embeddings"])]
NEWER_METHODS = METHODS + CHUNKED + DAPE_CASES + COPE_CASES + RULE_CASES
WITH_A_WINDOW = METHODS + CHUNKED + DAPE_CASES[:3] + COPE_CASES[:4] + RULE_CASES  # for the trimmed cache


def model_of(kernel, *flags):
    """A tiny model of the method; CoPE's with random tables (at zero, CoPE adds nothing)."""
    return cope_model(kernel, *flags) if "--cope" in flags else tiny_model(kernel, *flags)


@pytest.mark.parametrize("case", NEWER_METHODS, ids=method_id)
def test_incremental_decoding_equals_full_scoring(case):
    kernel, flags = case
    torch.manual_seed(0)
    model = model_of(kernel, *flags).eval()
    tokens = tokens_of()
    assert (log_probs(model, tokens) - log_probs(model, tokens, incremental=True)).abs().max() < 1e-5


@pytest.mark.parametrize("case", NEWER_METHODS, ids=method_id)
@pytest.mark.parametrize("window", [0, 7])
def test_blocks_give_the_result_of_one_block(case, window):
    kernel, flags = case
    torch.manual_seed(0)
    one = model_of(kernel, *flags, "--attention-block-size", "0", "--attn-window", str(window)).double().eval()
    blocked = tiny_model(kernel, *flags, "--attention-block-size", "4", "--attn-window", str(window)).double().eval()
    blocked.load_state_dict(one.state_dict())
    tokens = tokens_of()
    torch.testing.assert_close(log_probs(blocked, tokens), log_probs(one, tokens), rtol=0, atol=1e-6)


@pytest.mark.parametrize("case", WITH_A_WINDOW, ids=method_id)
def test_trimmed_cache_equals_scoring_with_the_window(case):
    kernel, flags = case
    torch.manual_seed(0)
    trimmed = model_of(kernel, *flags, "--max-cache-window", "6").double().eval()
    windowed = tiny_model(kernel, *flags, "--attn-window", "6").double().eval()
    windowed.load_state_dict(trimmed.state_dict())
    tokens = tokens_of()
    decoded = log_probs(trimmed, tokens, incremental=True)
    torch.testing.assert_close(decoded, log_probs(windowed, tokens), rtol=0, atol=1e-6)
    assert (decoded - log_probs(trimmed, tokens)).abs().max() > 1e-6, "the window changes the result"


def beam_search_matches_full_scoring(model):
    """fairseq's SequenceGenerator (beam 3, which reorders the cache) scores each hypothesis as full
    scoring of its tokens does."""
    from fairseq.sequence_generator import SequenceGenerator

    dictionary = model.decoder.dictionary
    generator = SequenceGenerator([model], dictionary, beam_size=3, max_len_b=14, min_len=14)
    prefix = tokens_of(1, 5, seed=3)
    sample = {"net_input": {"src_tokens": prefix, "src_lengths": torch.tensor([5])}}
    with torch.no_grad():
        hypotheses = generator.generate([model], sample, prefix_tokens=prefix)[0]
    assert len(hypotheses) == 3
    for hyp in hypotheses:
        tokens = torch.cat([torch.tensor([dictionary.eos()]), hyp["tokens"]])[None]
        scores = log_probs(model, tokens[:, :-1]).gather(-1, tokens[:, 1:, None])[0, :, 0]
        torch.testing.assert_close(hyp["positional_scores"].double(), scores, rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", NEWER_METHODS, ids=method_id)
def test_beam_search_scores_equal_full_scoring(case):
    kernel, flags = case
    torch.manual_seed(0)
    beam_search_matches_full_scoring(model_of(kernel, *flags).eval())
