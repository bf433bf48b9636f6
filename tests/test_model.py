"""The decoder: bias on every decoding path, built once per forward, shared parameters."""

import numpy as np
import pytest
import torch
from fairseq.models.transformer_lm import TransformerLanguageModel, base_lm_architecture

from kerple_core.kernels import KERNELS
from kerple_fairseq.models.transformer_lm_kerple import KernelBiasedLanguageModel

from helpers import TINY, TinyTask, parse_model_args, random_tokens, tiny_model


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


def window_flags(kernel):
    return ["--attn-window", "6"] if KERNELS[kernel].requires_window else []


def randomise_kernel(model):
    with torch.no_grad():
        for p in model.decoder.attention_bias.parameters():
            p.normal_(0.0, 1.0)


DECODING_CASES = [("transformer_lm_kerple", kernel, window_flags(kernel)) for kernel in sorted(KERNELS)] + [
    ("transformer_lm_kerple", "kerple_bias_wht", ["--attn-window", "5"]),  # weight path and window
    ("transformer_lm_rotary", "none", []),
    ("transformer_lm_rotary", "window", ["--attn-window", "5"]),
    ("transformer_lm_rotary", "none", ["--attn-window", "9"]),  # the super-baseline
]


def case_id(case):
    arch, kernel, flags = case
    return "-".join([arch.replace("transformer_lm_", ""), kernel, *[f.lstrip("-") for f in flags]])


@pytest.mark.parametrize("case", DECODING_CASES, ids=case_id)
def test_incremental_decoding_equals_full_sequence_scoring(case):
    arch, kernel, flags = case
    torch.manual_seed(0)
    model = tiny_model(kernel, *flags, arch=arch).eval()
    randomise_kernel(model)
    tokens = random_tokens()
    with torch.no_grad():
        full = full_log_probs(model, tokens)
        step = incremental_log_probs(model, tokens)
    assert (full - step).abs().max().item() < 1e-5


@pytest.mark.parametrize("kernel, flags", [
    ("alibi", []), ("kerple_log", []), ("gauss_wht1", []), ("none", ["--attn-window", "4"]),
    ("none", ["--rotary-embeddings"])])
def test_the_bias_changes_what_the_model_computes(kernel, flags):
    # guards the tests above: without the bias, weight, window or rotation on the incremental
    # path, the two would differ
    torch.manual_seed(0)
    model = tiny_model(kernel, *flags).eval()
    randomise_kernel(model)
    nope = tiny_model("none").eval()
    nope.load_state_dict(model.state_dict(), strict=False)
    tokens = random_tokens()
    with torch.no_grad():
        assert (full_log_probs(model, tokens) - full_log_probs(nope, tokens)).abs().max() > 1e-2


@pytest.mark.parametrize("case", [
    ("transformer_lm_alibi", "alibi", []),
    ("transformer_lm_kerple", "kerple_bias_wht", ["--attn-window", "5"]),
    ("transformer_lm_rotary", "none", ["--attn-window", "5"]),
    ("transformer_lm_kerple", "t5", []),
], ids=case_id)
def test_hub_style_sampling_uses_the_bias(case):
    """fairseq's SequenceGenerator (generate, hub sample()) decodes incrementally and reorders the
    cache between beams; its scores must be the full-sequence log-probabilities of its tokens."""
    from fairseq.sequence_generator import SequenceGenerator

    arch, kernel, flags = case
    torch.manual_seed(0)
    model = tiny_model(kernel, *flags, arch=arch).eval()
    randomise_kernel(model)
    task = TinyTask()
    generator = SequenceGenerator([model], task.target_dictionary, beam_size=3, max_len_b=12, min_len=12)
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
    assert model.decoder.attention_bias.kernel.r1.grad is not None
    model.eval()
    with torch.no_grad():
        model(tokens)
        model(tokens)
    assert len(calls) == 3, "frozen: built once, then cached"
    # an in-place write (load_state_dict, an optimiser stepping on the parameter) moves its version
    # counter; fairseq's optimisers write through .data in training mode, and entering it drops the cache
    with torch.no_grad():
        model.decoder.attention_bias.kernel.r1.add_(0.5)
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
    before = (kernel.value("r1").detach().clone(), kernel.value("r2").detach().clone())
    optimizer = FairseqAdam(Namespace(lr=[0.1], adam_betas="(0.9, 0.98)", adam_eps=1e-8, weight_decay=0.0,
                                      use_old_adam=False, fp16_adam_stats=False, tpu=False),
                            list(model.parameters()))
    model(random_tokens())[0].logsumexp(-1).mean().backward()
    optimizer.step()
    r1, r2 = kernel.value("r1"), kernel.value("r2")
    assert not torch.allclose(r1, before[0]) and not torch.allclose(r2, before[1])
    assert (r1 >= kernel.floor).all() and ((r2 >= kernel.floor) & (r2 <= 2.0)).all()  # the domain, bounds included


def test_bias_is_per_head_not_per_batch_element():
    from kerple_core.attention.distance_bias import DistanceBlockBias

    model = tiny_model("alibi").eval()
    shapes = []
    original = DistanceBlockBias.mask
    DistanceBlockBias.mask = lambda self, *a: shapes.append(tuple(original(self, *a).shape)) or original(self, *a)
    try:
        with torch.no_grad():
            model(random_tokens(batch=7, length=24))
    finally:
        DistanceBlockBias.mask = original
    assert shapes and set(shapes) == {(4, 24, 24)}
    assert model.decoder.buffered_future_mask(torch.zeros(24, 7, 32)) is None, "no fairseq future mask is built"


@pytest.mark.parametrize("kernel, flags", [("kerple_log", []), ("fox", []), ("fire", ["--fire-threshold", "4"])])
@pytest.mark.parametrize("wrapping", [["--checkpoint-activations"], ["--checkpoint-activations", "--offload-activations"]],
                         ids=["checkpoint", "offload"])
def test_layers_are_built_through_fairseqs_build_decoder_layer_hook(kernel, flags, wrapping):
    """The plugin's attention is built inside fairseq's layer, so activation checkpointing wraps the
    real module: same log-probabilities and gradients as without it, dropout included (the
    recomputation replays the same random numbers), for a learnable kernel and the layer biases."""
    from kerple_core.attention.self_attention import BiasedSelfAttention
    from kerple_fairseq.models.decoder import KernelBiasedDecoderLayer

    dropout = ["--dropout", "0.1", "--attention-dropout", "0.1"]
    torch.manual_seed(0)
    plain = tiny_model(kernel, *flags, *dropout).train()
    checkpointed = tiny_model(kernel, *flags, *dropout, *wrapping).train()
    checkpointed.load_state_dict(plain.state_dict())
    for layer in checkpointed.decoder.layers:
        assert isinstance(layer, KernelBiasedDecoderLayer) and isinstance(layer.self_attn, BiasedSelfAttention)
        assert getattr(layer, "precheckpoint_forward", None) is not None, "fairseq's checkpoint wrapper"
        assert layer.self_attn.setup is checkpointed.decoder.setup
    tokens = random_tokens()
    grads = []
    for model in (plain, checkpointed):
        model.zero_grad()
        torch.manual_seed(5)
        model(tokens)[0].logsumexp(-1).mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    learnable = {"kerple_log": "decoder.attention_bias.kernel.r1",
                 "fox": "decoder.layers.0.self_attn.layer_bias.gate.weight",
                 "fire": "decoder.layers.0.self_attn.layer_bias.hidden.weight"}[kernel]
    assert grads[0].keys() == grads[1].keys() and grads[0][learnable].abs().sum() > 0
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, msg=name)


def test_kernel_parameters_are_shared_by_all_layers():
    model = tiny_model("kerple_log", "--decoder-layers", "3")
    keys = [k for k in model.state_dict() if k.endswith((".r1", ".r2"))]
    assert keys == ["decoder.attention_bias.kernel.r1", "decoder.attention_bias.kernel.r2"]
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


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_half_precision_forward_is_finite_and_close_to_float32(kernel, dtype):
    torch.manual_seed(0)
    model = tiny_model(kernel, *window_flags(kernel)).eval()
    tokens = random_tokens(batch=1, length=2048)
    with torch.no_grad():
        reference = full_log_probs(model, tokens)
        half = full_log_probs(model.to(dtype), tokens)
    assert torch.isfinite(half).all()
    assert (half - reference).abs().max() < 0.1


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["alibi", "kerple_log", "kerple_power"])
def test_float16_forward_at_4096_matches_float32(kernel):
    """CPU half precision at L = 4096: log-probabilities within 0.02 of float32 (measured here:
    at most 0.005, mean 0.0005, for all three kernels)."""
    torch.manual_seed(0)
    model = tiny_model(kernel).eval()
    tokens = random_tokens(batch=1, length=4096)
    with torch.no_grad():
        reference = full_log_probs(model, tokens)
        half = full_log_probs(model.half(), tokens)
    assert torch.isfinite(half).all()
    assert (half - reference).abs().max() < 0.02


def test_set_window_drops_cached_biases():
    torch.manual_seed(0)
    model = tiny_model("alibi").eval()
    tokens = random_tokens()
    with torch.no_grad():
        before = full_log_probs(model, tokens)
        model.decoder.attention_bias.set_attention_window(4)
        windowed = full_log_probs(model, tokens)
        fresh = tiny_model("alibi", "--attn-window", "4").eval()
        fresh.load_state_dict(model.state_dict())
        torch.testing.assert_close(windowed, full_log_probs(fresh, tokens), rtol=0, atol=0)
    assert (windowed - before).abs().max() > 1e-3


def test_rotary_matches_complex_rotation_and_depends_on_relative_position_only():
    from kerple_core.attention.rotary import RotaryEmbedding

    torch.manual_seed(0)
    head_dim, length = 16, 40
    x = torch.randn(2, 3, length, head_dim, dtype=torch.float64)
    (rotated,) = RotaryEmbedding(head_dim)(x, offset=100)
    rotated = rotated.numpy()
    # RoFormer: the pair (x_k, x_{k+D/2}) as the complex number x_k + i x_{k+D/2}, times e^{i m theta_k}
    half = head_dim // 2
    theta = 10000.0 ** (-2.0 * np.arange(half) / head_dim)
    m = np.arange(100, 100 + length)[:, None]
    z = (x[..., :half].numpy() + 1j * x[..., half:].numpy()) * np.exp(1j * m * theta)
    np.testing.assert_allclose(rotated, np.concatenate([z.real, z.imag], axis=-1), rtol=1e-10, atol=1e-10)
    # q_m . k_n depends on m - n only: shifting both positions leaves the scores unchanged
    rope = RotaryEmbedding(head_dim)
    q, k = torch.randn(length, head_dim, dtype=torch.float64), torch.randn(length, head_dim, dtype=torch.float64)
    q0, k0 = rope(q, k)
    q777, k777 = rope(q, k, offset=777)
    torch.testing.assert_close(q777 @ k777.T, q0 @ k0.T)


@pytest.mark.parametrize("arch, flags, message", [
    ("transformer_lm_alibi", ["--rotary-embeddings"], "already encodes position, but rotary embeddings"),
    ("transformer_lm_rotary", ["--token-positional-embeddings"], "two position encodings"),
    ("transformer_lm_sinusoidal", ["--bias-kernel", "alibi"], "on in the transformer_lm_sinusoidal and "
     "transformer_lm_learned_pos architectures: train a kernel on transformer_lm_kerple"),
    ("transformer_lm_kerple", ["--bias-kernel", "window"], "needs --attn-window W > 0"),
])
def test_conflicting_position_options_are_clear_errors(arch, flags, message):
    from kerple_fairseq import KernelConfigError

    args = parse_model_args(arch, *TINY, *flags)
    with pytest.raises(KernelConfigError, match=message):
        KernelBiasedLanguageModel.build_model(args, TinyTask())


def test_weight_kernel_multiplies_the_scaled_logits():
    """One layer by hand: softmax((q.k/sqrt(d)) * W + B) for kerple_bias_wht."""
    torch.manual_seed(0)
    model = tiny_model("kerple_bias_wht").eval()
    attention = model.decoder.layers[0].self_attn
    x = torch.randn(10, 2, 32)
    with torch.no_grad():
        with model.decoder.attention_bias.forward_scope():
            out, weights = attention(x, x, x, need_weights=True, need_head_weights=True)
        heads, dim = 4, 8
        q = attention.q_proj(x).view(10, 2, heads, dim).permute(1, 2, 0, 3) / dim ** 0.5
        k = attention.k_proj(x).view(10, 2, heads, dim).permute(1, 2, 0, 3)
        kernel = model.decoder.attention_bias.kernel
        d = (torch.arange(10)[:, None] - torch.arange(10)[None, :]).float()
        r1, r2, r3, r4 = (kernel.value(n)[:, None, None] for n in ("r1", "r2", "r3", "r4"))
        causal = d >= 0
        dpos = d.clamp(min=0)
        weight = torch.exp(-r3 * dpos ** r4)
        bias = torch.where(causal, -r1 * dpos ** r2, torch.tensor(float("-inf")))
        expected = torch.softmax(q @ k.transpose(-1, -2) * weight + bias, dim=-1)
    torch.testing.assert_close(weights.transpose(0, 1), expected, atol=1e-6, rtol=1e-5)


def test_attention_weights_cover_every_key_with_a_window_and_a_cache():
    """Weights returned while decoding token by token under a window are the rows of the full
    weights: every cached key, 0 outside the window."""
    torch.manual_seed(0)
    model = tiny_model("alibi", "--attn-window", "4").eval()
    attention = model.decoder.layers[0].self_attn
    x = torch.randn(10, 2, 32)
    state = {}
    with torch.no_grad(), model.decoder.attention_bias.forward_scope():
        _, full = attention(x, x, x, need_weights=True, need_head_weights=True)  # [H, B, T, S]
        for t in range(10):
            step = x[t:t + 1]
            _, weights = attention(step, step, step, incremental_state=state, need_weights=True,
                                   need_head_weights=True)
            assert weights.shape == (4, 2, 1, t + 1)
            torch.testing.assert_close(weights[:, :, 0], full[:, :, t, :t + 1])
    distance = torch.arange(10)[:, None] - torch.arange(10)[None, :]
    assert torch.all(full[..., (distance >= 4) | (distance < 0)] == 0)
    assert torch.all(full[..., (distance < 4) & (distance >= 0)] > 0)
