"""The decoder: bias on every decoding path, built once per forward, shared parameters."""

import pytest
import torch
from fairseq.models.transformer_lm import TransformerLanguageModel, base_lm_architecture

from kerple_fairseq.kernels import KERNELS

from helpers import TINY, VOCAB, TinyTask, parse_model_args, tiny_model


def random_tokens(batch=3, length=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, VOCAB + 4, (batch, length), generator=g)


def full_log_probs(model, tokens):
    logits, _ = model(tokens)
    return torch.log_softmax(logits.float(), dim=-1)


def incremental_log_probs(model, tokens):
    state = {}
    steps = []
    for t in range(tokens.size(1)):
        logits, _ = model(tokens[:, : t + 1], incremental_state=state)
        steps.append(torch.log_softmax(logits.float(), dim=-1))
    return torch.cat(steps, dim=1)


def randomise_kernel(model):
    with torch.no_grad():
        for p in model.decoder.attention_bias.parameters():
            p.normal_(0.0, 1.0)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_incremental_decoding_equals_full_sequence_scoring(kernel):
    torch.manual_seed(0)
    model = tiny_model(kernel).eval()
    randomise_kernel(model)
    tokens = random_tokens()
    with torch.no_grad():
        full = full_log_probs(model, tokens)
        step = incremental_log_probs(model, tokens)
    assert (full - step).abs().max().item() < 1e-5


@pytest.mark.parametrize("kernel", ["alibi", "kerple_log"])
def test_the_bias_changes_what_the_model_computes(kernel):
    # guards the test above: without the bias on the incremental path, the two would differ
    torch.manual_seed(0)
    model = tiny_model(kernel).eval()
    randomise_kernel(model)
    nope = tiny_model("none").eval()
    nope.load_state_dict(model.state_dict(), strict=False)
    tokens = random_tokens()
    with torch.no_grad():
        assert (full_log_probs(model, tokens) - full_log_probs(nope, tokens)).abs().max() > 1e-2


def test_hub_style_sampling_uses_the_bias():
    """fairseq's SequenceGenerator (generate, hub sample()) decodes incrementally; its scores
    must be the full-sequence log-probabilities of the tokens it produced."""
    from fairseq.sequence_generator import SequenceGenerator

    torch.manual_seed(0)
    model = tiny_model("alibi").eval()
    task = TinyTask()
    generator = SequenceGenerator([model], task.target_dictionary, beam_size=2, max_len_b=12, min_len=12)
    prefix = random_tokens(batch=1, length=6)
    sample = {"net_input": {"src_tokens": prefix, "src_lengths": torch.tensor([6])}}
    with torch.no_grad():
        hypo = generator.generate([model], sample, prefix_tokens=prefix)[0][0]
        tokens = hypo["tokens"]
        bos = torch.tensor([task.target_dictionary.eos()])
        inputs = torch.cat([bos, tokens[:-1]])[None]
        full = full_log_probs(model, inputs)[0].gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(hypo["positional_scores"], full, atol=1e-5, rtol=0)


def count_kernel_calls(model):
    calls = []
    model.decoder.attention_bias.kernel.register_forward_hook(lambda *a: calls.append(1))
    return calls


def test_bias_is_built_once_per_forward_and_cached_while_frozen():
    model = tiny_model("kerple_log", "--decoder-layers", "4")
    calls = count_kernel_calls(model)
    tokens = random_tokens()
    model.train()
    model(tokens)[0].sum().backward()
    assert len(calls) == 1, "four layers, one bias"
    model(tokens)[0].sum().backward()
    assert len(calls) == 2, "training: rebuilt every forward (parameters change)"
    assert model.decoder.attention_bias.kernel.r1_raw.grad is not None
    model.eval()
    with torch.no_grad():
        model(tokens)
        model(tokens)
    assert len(calls) == 3, "frozen: built once, then cached"
    # optimisers write through .data, invisible to version counters; the cache must still see it
    model.decoder.attention_bias.kernel.r1_raw.data.add_(0.5)
    with torch.no_grad():
        cached = model(tokens)[0]
    assert len(calls) == 4, "a parameter write invalidates the cache"
    model.decoder.attention_bias._frozen_cache.clear()
    with torch.no_grad():
        torch.testing.assert_close(cached, model(tokens)[0], rtol=0, atol=0)
    model.train()
    model.eval()
    with torch.no_grad():
        model(tokens)
    assert len(calls) == 6, "a train/eval switch (fairseq: every step and validation) drops the cache"


def test_fairseq_optimizer_step_reaches_the_kernel_parameters():
    from fairseq.optim.adam import FairseqAdam
    from argparse import Namespace

    torch.manual_seed(0)
    model = tiny_model("kerple_power")
    kernel = model.decoder.attention_bias.kernel
    before = (kernel.r1.detach().clone(), kernel.r2.detach().clone())
    optimizer = FairseqAdam(Namespace(lr=[0.1], adam_betas="(0.9, 0.98)", adam_eps=1e-8, weight_decay=0.0,
                                      use_old_adam=False, fp16_adam_stats=False, tpu=False),
                            list(model.parameters()))
    model(random_tokens())[0].logsumexp(-1).mean().backward()
    optimizer.step()
    assert not torch.allclose(kernel.r1, before[0]) and not torch.allclose(kernel.r2, before[1])
    assert (kernel.r1 > kernel.floor).all() and ((kernel.r2 > kernel.floor) & (kernel.r2 < 2.0)).all()


def test_mask_is_per_head_not_per_batch_element():
    model = tiny_model("alibi")
    x = torch.zeros(24, 7, 32)  # T x B x C
    mask = model.decoder.buffered_future_mask(x)
    assert mask.shape == (4, 24, 24)


def test_kernel_parameters_are_shared_by_all_layers():
    model = tiny_model("kerple_log", "--decoder-layers", "3")
    keys = [k for k in model.state_dict() if "r1_raw" in k or "r2_raw" in k]
    assert keys == ["decoder.attention_bias.kernel.r1_raw", "decoder.attention_bias.kernel.r2_raw"]
    assert model.decoder.embed_positions is None


def test_none_kernel_equals_stock_transformer_lm_without_positions():
    torch.manual_seed(0)
    ours = tiny_model("none").eval()
    args = parse_model_args("transformer_lm", *TINY, "--no-token-positional-embeddings")
    base_lm_architecture(args)
    stock = TransformerLanguageModel.build_model(args, TinyTask()).eval()
    stock.load_state_dict(ours.state_dict())
    tokens = random_tokens()
    with torch.no_grad():
        torch.testing.assert_close(full_log_probs(ours, tokens), full_log_probs(stock, tokens), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kernel", ["alibi", "kerple_log", "kerple_power"])
def test_half_precision_forward_is_finite_at_long_length(kernel, dtype):
    torch.manual_seed(0)
    model = tiny_model(kernel).eval().to(dtype)
    tokens = random_tokens(batch=1, length=2048)
    with torch.no_grad():
        logits, _ = model(tokens)
    assert torch.isfinite(logits).all()
