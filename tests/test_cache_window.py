"""--max-cache-window w: incremental decoding with the key/value cache trimmed to the last w tokens
(Sandwich App. B) is the model's kernel composed with a window of w."""

import pytest
import torch

from helpers import VOCAB, tiny_model


def incremental(model, tokens):
    """Log-probabilities decoding one token per step, and the largest cache seen."""
    state, steps, largest = {}, [], 0
    with torch.no_grad():
        for end in range(1, tokens.size(1) + 1):
            logits, _ = model(tokens[:, :end], incremental_state=state)
            steps.append(torch.log_softmax(logits.double(), dim=-1))
            largest = max(largest, max(v["prev_key"].size(2) for v in state.values() if "prev_key" in v))
    return torch.cat(steps, dim=1), largest


def full(model, tokens):
    with torch.no_grad():
        return torch.log_softmax(model(tokens)[0].double(), dim=-1)


CASES = [("alibi", []), ("kerple_log", []), ("kerple_bias_wht", []), ("t5", []),
         ("none", ["--rotary-embeddings"]), ("window", ["--attn-window", "5"]), ("kerple_log", ["--attn-window", "20"])]


@pytest.mark.parametrize("kernel,flags", CASES, ids=lambda c: c if isinstance(c, str) else "-".join(c) or "plain")
def test_trimmed_cache_equals_scoring_with_the_window(kernel, flags):
    window = 8
    torch.manual_seed(0)
    trimmed = tiny_model(kernel, *flags, "--max-cache-window", str(window)).double().eval()
    model_window = int(flags[flags.index("--attn-window") + 1]) if "--attn-window" in flags else 0
    scoring_window = min(window, model_window) if model_window else window
    windowed = tiny_model(kernel, *[f for f in flags if f not in ("--attn-window", str(model_window))],
                          "--attn-window", str(scoring_window)).double().eval()
    windowed.load_state_dict(trimmed.state_dict())
    tokens = torch.randint(4, VOCAB + 4, (2, 40))
    decoded, largest = incremental(trimmed, tokens)
    # fairseq's softmax runs in float32 even for a float64 model: equal to float32 rounding
    torch.testing.assert_close(decoded, full(windowed, tokens), rtol=0, atol=1e-6)
    assert largest == window, "the cache never holds more than the window"
    if kernel != "window":  # a bias kernel without the trimmed cache sees further back
        untrimmed = tiny_model(kernel, *flags).double().eval()
        untrimmed.load_state_dict(trimmed.state_dict())
        assert (incremental(untrimmed, tokens)[0] - decoded).abs().max() > 1e-6


@pytest.mark.slow
def test_alibi_with_a_2048_cache_is_close_to_the_full_cache():
    """4 heads, slopes 1/4 .. 1/256: a key 2048 back is down-weighted by exp(-8) in the slowest head.
    Measured over tokens 2049..2400 of a 2400-token sequence: max |diff| of log-probabilities 4.6e-5 (mean 6e-6)."""
    torch.manual_seed(0)
    trimmed = tiny_model("alibi", "--max-cache-window", "2048").eval()
    whole = tiny_model("alibi").eval()
    whole.load_state_dict(trimmed.state_dict())
    tokens = torch.randint(4, VOCAB + 4, (1, 2400))
    trimmed_lprobs, largest = incremental(trimmed, tokens)
    whole_lprobs, _ = incremental(whole, tokens)
    assert largest == 2048
    assert torch.equal(trimmed_lprobs[:, :2048], whole_lprobs[:, :2048]), "identical until the cache is full"
    worst = (trimmed_lprobs[:, 2048:] - whole_lprobs[:, 2048:]).abs().max().item()
    assert 0 < worst < 1e-3, worst


def test_beam_search_with_a_trimmed_cache():
    """fairseq's SequenceGenerator reorders the cache (positions included) between beams."""
    from fairseq.sequence_generator import SequenceGenerator

    torch.manual_seed(0)
    model = tiny_model("none", "--rotary-embeddings", "--max-cache-window", "4").eval()
    windowed = tiny_model("none", "--rotary-embeddings", "--attn-window", "4").eval()
    windowed.load_state_dict(model.state_dict())
    dictionary = model.decoder.dictionary
    generator = SequenceGenerator([model], dictionary, beam_size=3, max_len_b=12, min_len=12)
    prefix = torch.randint(4, VOCAB + 4, (1, 5))
    sample = {"net_input": {"src_tokens": prefix, "src_lengths": torch.tensor([5])}}
    with torch.no_grad():
        hypotheses = generator.generate([model], sample, prefix_tokens=prefix)[0]
    for hyp in hypotheses:
        tokens = torch.cat([torch.tensor([dictionary.eos()]), hyp["tokens"]])[None]
        scores = full(windowed, tokens[:, :-1]).gather(-1, tokens[:, 1:, None])[0, :, 0]
        torch.testing.assert_close(hyp["positional_scores"].double(), scores.double(), rtol=0, atol=1e-4)


def test_negative_cache_window_is_refused():
    from kerple_fairseq.errors import KernelConfigError

    with pytest.raises(KernelConfigError, match="--max-cache-window must be >= 0"):
        tiny_model("alibi", "--max-cache-window", "-2")
