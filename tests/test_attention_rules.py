"""Stick-breaking attention, scalable softmax, Llama 4's temperature, SWAN-GPT's scaling, selective attention,
PaTH and ReRoPE in the plugin's attention module against the plain float64 loops of ``attention_rule_reference.py``:
weights or logits to 1e-12, gradients of every input and parameter to 1e-10. Their decoding paths:
test_decoding_paths_of_newer_methods.py; training and evaluation: test_newer_methods_training.py."""

import math

import pytest
import torch

from kerple_core.attention.self_attention import recorded
from kerple_fairseq.errors import KernelConfigError

from attention_rule_reference import (bam_prior, llama4_query_temperature, path_inputs, path_logits, rerope_logits,
                                      selective_logits, ssmax_logits, stick_breaking, swan_query_scale)
from helpers import parse_model_args, tiny_model
from reference import alibi_slopes_reference
from test_layer_biases import log_probs, method_id, tokens_of

LENGTH, BATCH = 7, 2


def attention_of(kernel, *flags):
    """Layer 0's self-attention of a float64 tiny model (every parameter moved from its initial
    value), a random input ``[T, B, E]`` and the parameters that reach the attention's output."""
    torch.manual_seed(0)
    attention = tiny_model(kernel, *flags).double().decoder.layers[0].self_attn
    with torch.no_grad():
        for p in attention.parameters():
            p.add_(0.3 * torch.randn_like(p))
    x = torch.randn(LENGTH, BATCH, attention.embed_dim, dtype=torch.float64, requires_grad=True)
    parameters = list(attention.parameters())
    return attention, x, parameters


def heads_of(attention, y):
    """``[B, H, T, D]`` from a projection ``[T, B, E]``."""
    return y.view(LENGTH, BATCH, attention.num_heads, attention.head_dim).permute(1, 2, 0, 3)


def raw_qkv(attention, x):
    """Unscaled, unrotated queries, keys and values ``[B, H, T, D]``."""
    return [heads_of(attention, proj(x)) for proj in (attention.q_proj, attention.k_proj, attention.v_proj)]


def causal_logits(q, k, window=0):
    """``q_i . k_j / sqrt(D)`` per head ``[T, T]``, ``-inf`` at hidden keys."""
    z = q @ k.T / math.sqrt(q.shape[-1])
    i, j = torch.arange(LENGTH)[:, None], torch.arange(LENGTH)[None, :]
    hidden = (j > i) | ((i - j >= window) if window else torch.zeros_like(j > i))
    return z.masked_fill(hidden, float("-inf"))


def assert_equal_with_gradients(ours, reference, inputs):
    """Values to 1e-12 where finite (and the same ``-inf`` cells), gradients of a random projection
    of the finite values to 1e-10 for every input."""
    finite = torch.isfinite(reference)
    assert torch.equal(finite, torch.isfinite(ours))
    torch.testing.assert_close(ours[finite], reference[finite], rtol=0, atol=1e-12)
    weights = torch.randn(reference[finite].shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    got = torch.autograd.grad((ours[finite] * weights).sum(), inputs, allow_unused=True, retain_graph=True)
    expected = torch.autograd.grad((reference[finite] * weights).sum(), inputs, allow_unused=True, retain_graph=True)
    for tensor, a, b in zip(inputs, got, expected):
        if b is None:
            assert a is None or a.abs().max() == 0, tensor.shape
            continue
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
        assert b.abs().max() > 0


def before_softmax(attention, x):
    """The module's logits ``[B, H, T, T]``, as an :class:`AttentionRecord` keeps them."""
    with recorded(attention, keep_logits=True) as record:
        attention(x, x, x, need_weights=False)
    (logits,) = record.logits
    return logits


@pytest.mark.parametrize("window", [0, 3])
def test_stick_breaking_weights_and_output_equal_the_loops(window):
    attention, x, parameters = attention_of("none", "--stick-breaking", "--attn-window", str(window))
    out, weights = attention(x, x, x, need_head_weights=True)  # weights [H, B, T, S]
    q, k, v = raw_qkv(attention, x)
    rows, outputs = [], []
    for b in range(BATCH):
        per_head, attended = [], []
        for h in range(attention.num_heads):
            a, rest, o = stick_breaking(causal_logits(q[b, h], k[b, h], window), v[b, h])
            per_head.append(a + torch.diag(rest))
            attended.append(o)
        rows.append(torch.stack(per_head))
        outputs.append(torch.stack(attended))
    reference = torch.stack(rows).transpose(0, 1)
    torch.testing.assert_close(weights.sum(-1), torch.ones_like(weights.sum(-1)), rtol=0, atol=1e-12)
    assert_equal_with_gradients(weights, reference, [x, *parameters])
    expected = attention.out_proj(torch.stack(outputs).permute(2, 0, 1, 3).reshape(LENGTH, BATCH, -1))
    assert_equal_with_gradients(out, expected, [x, *parameters])


def rotary_logits(q, k):
    """Plain rotary logits of one head by the loops (ReRoPE with a window beyond the length)."""
    return rerope_logits(q, k, window=LENGTH + 1)


@pytest.mark.parametrize("window", [0, 3])
def test_ssmax_logits_and_scale_gradients_equal_the_loops(window):
    attention, x, parameters = attention_of("none", "--rotary-embeddings", "--ssmax", "--attn-window", str(window))
    scale = attention.query_scales[0].scale
    assert any(p is scale for p in parameters)
    q, k, _ = raw_qkv(attention, x)
    reference = torch.stack([torch.stack([
        ssmax_logits(rotary_logits(q[b, h], k[b, h]), scale[h], window=window) for h in range(attention.num_heads)])
        for b in range(BATCH)])
    assert_equal_with_gradients(before_softmax(attention, x), reference, [x, *parameters])


@pytest.mark.parametrize("scope", ["logits", "queries"])
@pytest.mark.parametrize("window", [0, 3])
def test_ssmax_over_bam_scales_the_bias_as_its_scope_says(window, scope):
    """``logits`` (the default, SSMax's paper and BAM's code): ``s log(n) (q.k + B)``; ``queries``:
    ``s log(n) q.k + B``; gradients of BAM's shape, scale and location included."""
    attention, x, parameters = attention_of("bam", "--bam-loc-trainable", "--ssmax", "--ssmax-scope", scope,
                                            "--attn-window", str(window))
    kernel = attention.setup.bias.kernel
    with torch.no_grad():
        kernel.shape.copy_(torch.tensor([1.3, -0.4, 0.7, 2.2]))
        kernel.loc.copy_(torch.tensor([0.0, -0.6, 0.3, -1.5]))
        kernel.scale.add_(0.5)
    scale = attention.query_scales[0].scale
    q, k, _ = raw_qkv(attention, x)
    rows = []
    for b in range(BATCH):
        per_head = []
        for h in range(attention.num_heads):
            z = causal_logits(q[b, h], k[b, h], window)
            prior = bam_prior(kernel.shape[h], kernel.scale[h], kernel.loc[h], LENGTH, window)
            per_head.append(ssmax_logits(z + prior, scale[h], window=window) if scope == "logits"
                            else ssmax_logits(z, scale[h], window=window) + prior)
        rows.append(torch.stack(per_head))
    assert_equal_with_gradients(before_softmax(attention, x), torch.stack(rows),
                                [x, *parameters, *kernel.parameters()])


@pytest.mark.parametrize("kernel, window", [("none", 0), ("none", 3), ("fox", 0)])
def test_path_logits_and_gradients_equal_the_loops(kernel, window):
    """PaTH's logits against the Householder matrices multiplied out, w and beta computed token by token,
    gradients of the input and every parameter (PaTH-FoX: FoX's sums of log f added)."""
    attention, x, parameters = attention_of(kernel, "--path-attention", "--attn-window", str(window))
    path = attention.score_transform
    q, k, _ = raw_qkv(attention, x)
    rows = []
    for b in range(BATCH):
        w, beta = path_inputs(x[:, b], path.w_proj[0].weight, path.w_proj[1].weight, path.w_conv.weight,
                              path.beta_proj.weight, path.beta_proj.bias, attention.num_heads)
        rows.append(torch.stack([path_logits(q[b, h], k[b, h], w[h], beta[h], window)
                                 for h in range(attention.num_heads)]))
    reference = torch.stack(rows)
    if kernel == "fox":  # D_ij = c_i - c_j, c the running sum of log f
        log_f = torch.nn.functional.logsigmoid(attention.layer_bias.gate(x)).permute(1, 2, 0)  # [B, H, T]
        c = log_f.cumsum(-1)
        reference = reference + (c[..., :, None] - c[..., None, :])
    assert_equal_with_gradients(before_softmax(attention, x), reference, [x, *parameters])


def test_llama4_temperature_scales_the_queries_from_its_floor_on():
    attention, x, parameters = attention_of("none", "--rotary-embeddings", "--attn-temperature-tuning",
                                            "--attn-temperature-layers", "all",
                                            "--attn-temperature-floor-scale", "3", "--attn-temperature-scale", "0.7")
    q, k, _ = raw_qkv(attention, x)
    factors = torch.tensor([llama4_query_temperature(i, beta=0.7, floor_scale=3) for i in range(LENGTH)],
                           dtype=torch.float64)
    assert factors[1] == 1 and factors[2] > 1 and factors[5] > factors[4]
    reference = torch.stack([torch.stack([rotary_logits(q[b, h], k[b, h]) * factors[:, None]
                                          for h in range(attention.num_heads)]) for b in range(BATCH)])
    assert_equal_with_gradients(before_softmax(attention, x), reference, [x, *parameters])


def test_swan_scaling_scales_the_queries_of_nope_layers_in_evaluation_only():
    attention, x, parameters = attention_of("alibi", "--swan-scaling", "--swan-scaling-base", "3")
    q, k, _ = raw_qkv(attention, x)
    factors = torch.tensor([swan_query_scale(i, base=3.0) for i in range(LENGTH)], dtype=torch.float64)
    assert factors[0] == 1 and factors[1] > 1
    alibi = torch.stack([torch.stack([-m * (torch.arange(LENGTH)[:, None] - torch.arange(LENGTH)[None, :])
                                      .double() for m in alibi_slopes_reference(attention.num_heads)])])
    unscaled = torch.stack([torch.stack([causal_logits(q[b, h], k[b, h]) for h in range(attention.num_heads)])
                            for b in range(BATCH)])
    attention.eval()  # an inference-time scale; the bias is added unscaled
    assert_equal_with_gradients(before_softmax(attention, x), unscaled * factors[:, None] + alibi, [x, *parameters])
    attention.train()
    assert_equal_with_gradients(before_softmax(attention, x), unscaled + alibi, [x, *parameters])


@pytest.mark.parametrize("window", [0, 3])
def test_selective_logits_equal_the_loops(window):
    attention, x, parameters = attention_of("none", "--selective-attention", "--attn-window", str(window))
    q, k, _ = raw_qkv(attention, x)
    reference = torch.stack([selective_logits(torch.stack([causal_logits(q[b, h], k[b, h], window)
                                                           for h in range(attention.num_heads)]))
                             for b in range(BATCH)])
    ours = before_softmax(attention, x)
    differs = torch.isfinite(reference) & (ours != torch.stack([torch.stack([causal_logits(q[b, h], k[b, h], window)
                                                                             for h in range(attention.num_heads)])
                                                                for b in range(BATCH)]))
    assert differs.any(), "some key is hidden"
    assert_equal_with_gradients(ours, reference, [x, *parameters])


@pytest.mark.parametrize("query_scale", ["log", "none"])
@pytest.mark.parametrize("scaling, leak", [("rerope", None), ("leaky-rerope", 2.5)])
def test_rerope_logits_equal_the_loops(scaling, leak, query_scale):
    """With the reference's query scale (the default) beyond the training length of 4, and without it."""
    flags = ["--rotary-embeddings", "--rotary-scaling", scaling, "--rerope-window", "3", "--tokens-per-sample", "4",
             "--rerope-query-scale", query_scale]
    attention, x, parameters = attention_of("none", *flags, *(["--rerope-leak", str(leak)] if leak else []))
    q, k, _ = raw_qkv(attention, x)
    train_length = 4 if query_scale == "log" else None
    reference = torch.stack([torch.stack([rerope_logits(q[b, h], k[b, h], 3, leak, train_length=train_length)
                                          for h in range(attention.num_heads)]) for b in range(BATCH)])
    assert_equal_with_gradients(before_softmax(attention, x), reference, [x, *parameters])


def test_rerope_scales_queries_by_default_as_the_reference_does():
    """bojone/rerope's patches: queries times max(1, log(i + 1) / log L_train); 1 up to the training length."""
    flags = ["--rotary-embeddings", "--rotary-scaling", "rerope", "--rerope-window", "3", "--tokens-per-sample", "4"]
    attention, x, _ = attention_of("none", *flags)
    default = before_softmax(attention, x)
    attention.setup.rotary.rerope_query_scale = "none"
    unscaled = before_softmax(attention, x)
    factor = torch.tensor([max(1.0, math.log(i + 1) / math.log(4)) for i in range(LENGTH)], dtype=torch.float64)
    finite = torch.isfinite(unscaled)
    torch.testing.assert_close(default[finite], (unscaled * factor[:, None])[finite], rtol=0, atol=1e-12)
    assert factor[3] == 1 and factor[4] > 1


def test_rerope_window_defaults_to_a_quarter_of_the_training_length():
    rotary = tiny_model("none", "--rotary-embeddings", "--rotary-scaling", "rerope",
                        "--tokens-per-sample", "512").decoder.setup.rotary
    assert rotary.rerope_window_size() == 128 and "window 128" in repr(rotary)


def test_ssmax_has_a_scale_per_head_in_each_layer_and_changes_nothing_else():
    model = tiny_model("none", "--rotary-embeddings", "--ssmax", "--ssmax-scale-init", "0.25")
    plain = tiny_model("none", "--rotary-embeddings")
    extra = set(model.state_dict()) - set(plain.state_dict())
    assert extra == {f"decoder.layers.{i}.self_attn.query_scales.0.scale" for i in range(2)}
    assert all(torch.equal(model.state_dict()[name], torch.full((4,), 0.25)) for name in extra)
    assert set(plain.state_dict()) <= set(model.state_dict())


@pytest.mark.parametrize("flags, message", [
    (["--selective-attention", "--dape", "mlp"], "--dape and --selective-attention each rewrite the attention logits"),
    (["--selective-attention", "--cope"], "--cope and --selective-attention each rewrite the attention logits"),
    (["--rotary-embeddings", "--rotary-scaling", "rerope", "--selective-attention", "--tokens-per-sample", "8"],
     "--selective-attention and --rotary-scaling rerope each rewrite the attention logits"),
    (["--rotary-embeddings", "--rotary-scaling", "rerope", "--rotary-xpos", "--tokens-per-sample", "8"],
     "--rotary-scaling rerope is for plain rotary models, not with --rotary-xpos"),
    (["--rotary-embeddings", "--rotary-scaling", "leaky-rerope", "--rerope-leak", "1", "--tokens-per-sample", "8"],
     "--rerope-leak must be > 1, got 1.0"),
    (["--rotary-embeddings", "--rotary-scaling", "rerope", "--rerope-window", "-2", "--tokens-per-sample", "8"],
     "--rerope-window must be >= 0"),
    (["--rotary-embeddings", "--rotary-scaling", "rerope", "--tokens-per-sample", "1"],
     "it needs --tokens-per-sample >= 2 \\(or --rerope-query-scale none\\)"),
    (["--ssmax", "--ssmax-scale-init", "nan"], "--ssmax-scale-init must be a finite number"),
    (["--attn-temperature-tuning", "--attn-temperature-floor-scale", "0"], "--attn-temperature-floor-scale must be >= 1"),
    (["--rotary-embeddings", "--attn-temperature-tuning"],
     "this model has no layer where --attn-temperature-tuning acts: it acts in the layers without rotary embeddings "
     "only \\(Llama 4's rule; --attn-temperature-layers all: in every layer\\)"),
    (["--layer-positions", "rotary+attn_temperature,nope"],
     "--layer-positions names attn_temperature in a layer where it does not act"),
    (["--swan-scaling", "--swan-scaling-base", "1"], "--swan-scaling-base must be a finite number > 1, got 1.0"),
    (["--rotary-embeddings", "--swan-scaling"],
     "this model has no layer where --swan-scaling acts: it acts in the layers without rotary embeddings only"),
])
def test_bad_options_are_clear_errors(flags, message):
    with pytest.raises(KernelConfigError, match=message):
        tiny_model("none", *flags)


def test_rotary_scalings_refused_together_before_the_build_and_when_changed_at_evaluation():
    """The scalings' one rule (``check_together``) is read by the model's validator from the arguments, with no
    module built, and by a built embedding whose scaling is changed on a trained model."""
    from kerple_core.attention.rotary import RotaryEmbedding
    from kerple_fairseq.models.composition import check_model

    args = parse_model_args("transformer_lm_kerple", "--bias-kernel", "none", "--rotary-embeddings",
                            "--rotary-xpos", "--rotary-fraction", "0.5")
    with pytest.raises(KernelConfigError, match="^--rotary-fraction is for plain rotary models, not with --rotary-xpos$"):
        check_model(args)
    args.rotary_fraction = 1.0
    check_model(args)
    rotary = RotaryEmbedding(8, args, train_length=16)
    with pytest.raises(KernelConfigError, match="^--rotary-scaling rerope is for plain rotary models, not with "
                                                "--rotary-xpos$"):
        rotary.set_scaling("rerope", 16)
    assert rotary.scaling == "none", "a refused scaling changes nothing"
    rotary.set_scaling("ntk", 16, 64)
    assert rotary.scaling == "ntk"


def test_an_unknown_ssmax_scope_is_a_clear_error():
    """The command line's choices refuse it first; a configuration built otherwise (Hydra, a checkpoint's)
    is refused by the method."""
    from kerple_core.attention.methods.ssmax import ScalableSoftmax

    with pytest.raises(KernelConfigError, match="--ssmax-scope must be one of logits, queries, got 'bias'"):
        ScalableSoftmax(4, ssmax_scope="bias")


# ---------------------------------------------------------------- in the model

CASES = [  # (bias kernel, flags): each rule alone and over a kernel
    ("none", ["--stick-breaking"]),
    ("alibi", ["--stick-breaking"]),
    ("none", ["--selective-attention"]),
    ("kerple_log", ["--selective-attention"]),
    ("none", ["--rotary-embeddings", "--ssmax"]),
    ("kerple_log", ["--ssmax", "--attn-temperature-tuning", "--attn-temperature-floor-scale", "4"]),
    ("none", ["--rotary-embeddings", "--rotary-scaling", "rerope", "--rerope-window", "5", "--tokens-per-sample", "8"]),
    ("bam", ["--ssmax", "--ssmax-scale-init", "1"]),
    ("none", ["--rotary-embeddings", "--rotary-scaling", "leaky-rerope", "--rerope-window", "5", "--rerope-leak", "3",
              "--tokens-per-sample", "8"]),
    ("none", ["--path-attention"]),
    ("fox", ["--path-attention"]),
    ("alibi", ["--swan-scaling", "--swan-scaling-base", "4"]),
]
#: PaTH carries every key to each query in turn, a Python step per query: half precision is checked at 4096 tokens
#: without gradients and at 512 with them (test_path_in_half_precision), not here
HALF_PRECISION_CASES = [case for case in CASES[::2] if "--path-attention" not in case[1]]


@pytest.mark.parametrize("case", CASES, ids=method_id)
def test_the_rule_changes_what_the_model_computes(case):
    kernel, flags = case
    torch.manual_seed(0)
    model = tiny_model(kernel, *flags).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    rule = {"--stick-breaking", "--selective-attention", "--ssmax", "--attn-temperature-tuning", "--path-attention",
            "--swan-scaling"}
    plain = [f for f in flags if f not in rule]
    if "--rotary-scaling" in plain:
        plain = plain[:plain.index("--rotary-scaling")]
    without = tiny_model(kernel, *plain).eval()
    without.load_state_dict({k: v for k, v in model.state_dict().items()
                             if "query_scales" not in k and "score_transform" not in k})
    tokens = tokens_of()
    assert (log_probs(model, tokens) - log_probs(without, tokens)).abs().max() > 1e-3


@pytest.mark.parametrize("scope", ["logits", "queries"])
@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_query_scales_are_served_by_the_fused_backends(monkeypatch, backend, scope):
    """Scalable softmax and the temperature scale the queries (and SSMax the bias, row by row): sdpa
    and FlexAttention (eager here; compiled: test_flex_attention.py) attend as the explicit path does."""
    from kerple_core.attention import flex

    monkeypatch.setattr(flex, "COMPILED", False)
    flags = ["--ssmax", "--ssmax-scope", scope, "--attn-temperature-tuning", "--attn-temperature-floor-scale", "4"]
    torch.manual_seed(0)
    fused = tiny_model("kerple_log", *flags, "--attention-backend", backend).eval()
    explicit = tiny_model("kerple_log", *flags, "--attention-backend", "explicit").eval()
    explicit.load_state_dict(fused.state_dict())
    tokens = tokens_of()
    with recorded(fused) as fused_record, recorded(explicit) as explicit_record:
        torch.testing.assert_close(log_probs(fused, tokens), log_probs(explicit, tokens), rtol=0, atol=1e-5)
    assert set(fused_record.backends) == {backend} and set(explicit_record.backends) == {"explicit"}


@pytest.mark.slow
@pytest.mark.parametrize("case", HALF_PRECISION_CASES + [("none", ["--rotary-embeddings", "--rotary-scaling", "leaky-rerope",
                                                         "--tokens-per-sample", "128"])], ids=method_id)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_at_4096_tokens_is_finite_and_close(case, dtype):
    """Forward at 4096 tokens close to float32; backward finite (the training step)."""
    kernel, flags = case
    torch.manual_seed(0)
    model = tiny_model(kernel, *flags).eval()
    tokens = tokens_of(1, 4096)
    with torch.no_grad():
        full = torch.log_softmax(model(tokens)[0].float(), dim=-1)
    model = model.to(dtype)
    logits = model(tokens)[0]
    half = torch.log_softmax(logits.float(), dim=-1)
    assert torch.isfinite(half).all()
    assert (half - full).abs().mean() < 0.05
    half.gather(-1, tokens[..., None]).mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["none", "fox"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_path_in_half_precision(kernel, dtype):
    """PaTH (and PaTH-FoX) at 4096 tokens: finite and close to float32; a training step at 512: finite gradients."""
    torch.manual_seed(0)
    model = tiny_model(kernel, "--path-attention").eval()
    for length, backward in ((4096, False), (512, True)):
        tokens = tokens_of(1, length)
        with torch.no_grad():
            full = torch.log_softmax(model.float()(tokens)[0].float(), dim=-1)
        half_model = model.to(dtype)
        with torch.set_grad_enabled(backward):
            half = torch.log_softmax(half_model(tokens)[0].float(), dim=-1)
        assert torch.isfinite(half).all()
        assert (half.detach() - full).abs().mean() < 0.05
        if backward:
            half.gather(-1, tokens[..., None]).mean().backward()
            assert all(torch.isfinite(p.grad).all() for p in half_model.parameters() if p.grad is not None)
            assert half_model.decoder.layers[0].self_attn.score_transform.beta_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("case", CASES[:3] + [("alibi", [])], ids=method_id)
def test_attention_by_distance_is_the_mean_weight_over_queries_by_loops(case):
    """kerple-analyze attention's curves: each layer's weight on the key d back, averaged over every
    query of every segment that has one, equal to loops over the returned weights; each query's
    weights sum to one (stick-breaking's remainder on its own key)."""
    from kerple_fairseq.analysis.attention_by_distance import attention_by_distance, attention_weights

    kernel, flags = case
    torch.manual_seed(0)
    model = tiny_model(kernel, *flags).eval()
    stream, length, segments = tokens_of(1, 40, seed=4)[0], 12, 3
    found = attention_by_distance(model, stream, length, segments, max_tokens=24, device="cpu")
    captured = attention_weights(model, stream[:segments * length].view(segments, length))
    for layer, weights in enumerate(captured):
        torch.testing.assert_close(weights.sum(-1), torch.ones_like(weights.sum(-1)), rtol=0, atol=1e-5)
        for h in range(weights.shape[0]):
            for d in range(length):
                cells = [weights[h, b, i, i - d].item() for b in range(segments) for i in range(d, length)]
                assert found.weights[layer, h, d] == pytest.approx(sum(cells) / len(cells), abs=1e-6)
            total = sum((i - j) * weights[h, b, i, j].item() for b in range(segments) for i in range(length)
                        for j in range(i + 1))
            assert found.mean_distance[layer, h] == pytest.approx(total / (segments * length), abs=1e-5)
