"""FIRE and the Forgetting Transformer's biases against plain float64 loops of their formulas (values
and gradients), and in the model: per layer, one block at a time, in half precision (their decoding
paths: test_decoding_paths_of_newer_methods.py)."""

import pytest
import torch

from kerple_core.attention.blocks import QueryBlock
from kerple_fairseq.errors import KernelConfigError
from kerple_core.layer_biases import LAYER_BIASES, build_layer_bias
from kerple_core.layer_biases.fire import FireBias
from kerple_core.layer_biases.fox import ForgetBiasOnly, ForgetGateBias
from kerple_core.visibility import VISIBILITY_RULES

from helpers import VOCAB, parse_model_args, tiny_model

# ---------------------------------------------------------------- plain-loop references


def fire_reference(p, i, j):
    """FIRE's ``b_h(i, j)`` for one cell, scalar by scalar: ``MLP(psi(i - j) / (psi(max(L, i)) + 1e-6))``,
    ``psi(x) = log(|c| x + 1)``, ``L = |m L0|``, MLP = Linear(1, W), ReLU, Linear(W, H)."""
    c = abs(p["c"])
    threshold = abs(p["threshold_multiplier"] * p["threshold_base"])
    normaliser_position = threshold if threshold > i else torch.tensor(float(i), dtype=torch.float64)
    u = torch.log(c * (i - j) + 1) / (torch.log(c * normaliser_position + 1) + 1e-6)
    width, heads = p["hidden.weight"].shape[0], p["out.weight"].shape[0]
    hidden = [torch.relu(p["hidden.weight"][k, 0] * u + p["hidden.bias"][k]) for k in range(width)]
    return [p["out.bias"][h] + sum(p["out.weight"][h, k] * hidden[k] for k in range(width)) for h in range(heads)]


def fox_reference(weight, bias, x, i, j, b):
    """``D_ij = sum_{l=j+1..i} log sigmoid(w_h . x_l + b_h)`` of batch element ``b``, per head, by loops."""
    heads, embed = weight.shape
    out = []
    for h in range(heads):
        total = torch.zeros((), dtype=torch.float64)
        for step in range(j + 1, i + 1):
            logit = bias[h] + sum(weight[h, e] * x[step, b, e] for e in range(embed))
            total = total + torch.log(1 / (1 + torch.exp(-logit)))
        out.append(total)
    return out


def visible_cells(block, first_position):
    """(t, s, i, j) for every cell of ``block`` whose key the query may see (no window)."""
    for t in range(block.num_queries):
        for s in range(block.num_keys):
            distance = block.offset + t - s
            if distance >= 0:
                i = first_position + block.query_start + t
                yield t, s, i, i - distance


FIRE_BLOCKS = [  # (block, absolute position of the call's first query)
    (QueryBlock(0, 12, 0, 12, 0), 0),  # rows below and beyond the threshold 8.45
    (QueryBlock(0, 1, 0, 8, 7), 20),  # one new query after a cache trimmed to 8 keys
    (QueryBlock(4, 9, 2, 9, 2), 3),  # a later block of a windowed call
]


@pytest.mark.parametrize("block, first_position", FIRE_BLOCKS)
def test_fire_bias_and_gradients_equal_the_formula_by_loops(block, first_position):
    torch.manual_seed(0)
    fire = FireBias(3, 16, fire_mlp_width=5, fire_threshold=6.5).double()
    with torch.no_grad():
        for p in fire.parameters():
            p.normal_(0.0, 0.7)
        fire.c.fill_(-0.3)  # used as |c|
        fire.threshold_multiplier.fill_(1.3)  # L = 8.45
    bias = fire.block_bias(block, first_position, None)
    assert bias.shape == (3, block.num_queries, block.num_keys) and bias.dtype == torch.float64
    reference = {name: p.detach().clone().requires_grad_(p.requires_grad) for name, p in fire.named_parameters()}
    reference["threshold_base"] = fire.threshold_base
    cotangent = torch.randn(bias.shape, dtype=torch.float64)
    ours, theirs = 0.0, 0.0
    for t, s, i, j in visible_cells(block, first_position):
        expected = fire_reference(reference, i, j)
        for h in range(3):
            assert abs(bias[h, t, s].item() - expected[h].item()) < 1e-12, (h, i, j)
            ours = ours + cotangent[h, t, s] * bias[h, t, s]
            theirs = theirs + cotangent[h, t, s] * expected[h]
    ours.backward()
    theirs.backward()
    for name, p in fire.named_parameters():
        expected = reference[name].grad
        expected = torch.zeros_like(p) if expected is None else expected  # the cells do not use it
        torch.testing.assert_close(p.grad, expected, rtol=1e-10, atol=1e-12, msg=name)
    if any(0 < j < i < 8.45 for _, _, i, j in visible_cells(block, first_position)):
        assert fire.threshold_multiplier.grad != 0, "the threshold is learned (rows below L use it)"


def test_fire_threshold_defaults_to_an_eighth_of_the_training_length_and_is_saved():
    args = parse_model_args("transformer_lm_kerple", "--bias-kernel", "fire", "--tokens-per-sample", "512")
    assert build_layer_bias("fire", 4, 32, args).threshold_base.item() == 64  # the reference's L0 for 512
    args.fire_threshold = 20.0
    fire = build_layer_bias("fire", 4, 32, args)
    assert fire.threshold_base.item() == 20 and "threshold_base" in fire.state_dict()


def test_fire_rows_beyond_the_threshold_are_not_toeplitz():
    fire = FireBias(2, 8, fire_threshold=4.0)
    bias = fire.block_bias(QueryBlock(0, 16, 0, 16, 0), 0, None)
    # distance 1 of queries 2 and 3 (both normalised by L = 4) agree; of queries 9 and 12 they differ
    torch.testing.assert_close(bias[:, 2, 1], bias[:, 3, 2])
    assert (bias[:, 9, 8] - bias[:, 12, 11]).abs().max() > 1e-4


@pytest.mark.parametrize("cls", [ForgetGateBias, ForgetBiasOnly])
def test_fox_bias_and_gradients_equal_the_running_sum_by_loops(cls):
    torch.manual_seed(1)
    heads, embed, length, batch = 2, 3, 7, 2
    fox = cls(heads, embed).double()
    with torch.no_grad():
        for p in fox.parameters():
            p.normal_(0.0, 1.0)
    x = torch.randn(length, batch, embed, dtype=torch.float64, requires_grad=True)
    state = fox.key_state(x, None)
    assert state.shape == (batch, heads, length) and state.dtype == torch.float64
    bias = fox.block_bias(QueryBlock(0, length, 0, length, 0), 0, state)
    assert bias.shape == (batch, heads, length, length)
    weight = fox.gate.weight if cls is ForgetGateBias else torch.zeros(heads, embed, dtype=torch.float64)
    gate_bias = fox.gate.bias if cls is ForgetGateBias else fox.gate_bias
    ref_weight = weight.detach().clone().requires_grad_(cls is ForgetGateBias)
    ref_bias = gate_bias.detach().clone().requires_grad_()
    ref_x = x.detach().clone().requires_grad_()
    cotangent = torch.randn(bias.shape, dtype=torch.float64)
    ours, theirs = 0.0, 0.0
    for b in range(batch):
        for i in range(length):
            for j in range(i + 1):
                expected = fox_reference(ref_weight, ref_bias, ref_x, i, j, b)
                for h in range(heads):
                    assert abs(bias[b, h, i, j].item() - expected[h].item()) < 1e-12
                    ours = ours + cotangent[b, h, i, j] * bias[b, h, i, j]
                    theirs = theirs + cotangent[b, h, i, j] * expected[h]
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(gate_bias.grad, ref_bias.grad, rtol=1e-10, atol=1e-12)
    if cls is ForgetGateBias:
        torch.testing.assert_close(fox.gate.weight.grad, ref_weight.grad, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-10, atol=1e-12)  # the bias depends on content
    else:
        assert x.grad is None or x.grad.abs().max() == 0  # data-independent


def test_fox_state_continues_from_the_cached_positions():
    torch.manual_seed(2)
    fox = ForgetGateBias(4, 8)
    x = torch.randn(10, 3, 8)
    whole = fox.key_state(x, None)
    torch.testing.assert_close(fox.key_state(x[6:], fox.key_state(x[:6], None)), whole[..., 6:])
    assert whole.dtype == torch.float32 and fox.half().key_state(x.half(), None).dtype == torch.float32


def test_fox_bias_only_is_alibi_with_a_learned_slope():
    fox = ForgetBiasOnly(3, 8)
    with torch.no_grad():
        fox.gate_bias.copy_(torch.tensor([2.0, 0.0, -1.0]))
    bias = fox.block_bias(QueryBlock(0, 6, 0, 6, 0), 0, fox.key_state(torch.randn(6, 1, 8), None))[0]
    slopes = -torch.nn.functional.logsigmoid(fox.gate_bias.detach())
    distance = torch.arange(6)[:, None] - torch.arange(6)[None, :]
    torch.testing.assert_close(bias.tril(), (-slopes[:, None, None] * distance).tril())


# ---------------------------------------------------------------- in the model

METHODS = [("fire", []), ("fox", []), ("fox_bias_only", [])]


def method_id(case):
    kernel, flags = case
    return "-".join([kernel, *[f.lstrip("-") for f in flags]])


def log_probs(model, tokens, incremental=False):
    with torch.no_grad():
        if not incremental:
            return torch.log_softmax(model(tokens)[0].double(), dim=-1)
        state, steps = {}, []
        for end in range(1, tokens.size(1) + 1):
            steps.append(torch.log_softmax(model(tokens[:, :end], incremental_state=state)[0].double(), dim=-1))
        return torch.cat(steps, dim=1)


def tokens_of(batch=2, length=30, seed=0):
    return torch.randint(4, VOCAB + 4, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", METHODS, ids=method_id)
def test_each_layer_has_its_own_parameters(case):
    kernel, flags = case
    torch.manual_seed(0)
    model = tiny_model(kernel, *flags)
    state = model.state_dict()
    per_layer = [{k.split("layer_bias.")[1]: v for k, v in state.items() if k.startswith(f"decoder.layers.{n}.self_attn.layer_bias.")}
                 for n in range(2)]
    assert per_layer[0] and per_layer[0].keys() == per_layer[1].keys()
    assert not any(k.startswith("decoder.attention_bias.kernel.") for k in state if "precision" not in k)
    first, second = (model.decoder.layers[n].self_attn.layer_bias for n in range(2))
    with torch.no_grad():
        for p in first.parameters():
            p.add_(1.0)
    assert all(torch.equal(v, second.state_dict()[k]) for k, v in per_layer[1].items()), "layer 1 is its own"


@pytest.mark.parametrize("case", METHODS, ids=method_id)
def test_the_bias_changes_what_the_model_computes(case):
    # guards the tests above: a bias ignored on some path would go unnoticed if it did nothing
    kernel, flags = case
    torch.manual_seed(0)
    model = tiny_model(kernel, *flags).eval()
    nope = tiny_model("none").eval()
    nope.load_state_dict(model.state_dict(), strict=False)
    tokens = tokens_of()
    assert (log_probs(model, tokens) - log_probs(nope, tokens)).abs().max() > 1e-2


def test_fox_attends_long_sequences_one_block_at_a_time(monkeypatch):
    """No [batch, heads, L, L] bias: with blocks of 8 queries, no block's bias has more than 8 rows."""
    shapes = []
    block_bias = ForgetGateBias.block_bias

    def recording(self, *args):
        bias = block_bias(self, *args)
        shapes.append(tuple(bias.shape))
        return bias

    monkeypatch.setattr(ForgetGateBias, "block_bias", recording)
    model = tiny_model("fox", "--attention-block-size", "8").eval()
    with torch.no_grad():
        model(tokens_of(2, 40))
    assert shapes and all(s[0] == 2 and s[2] <= 8 for s in shapes), shapes
    assert len(shapes) == 2 * 5  # two layers, five blocks each


#: chunked attention in chunks shorter than the test's 2048 tokens (its default, Llama 4's 8192, would mask nothing)
HALF_PRECISION_FLAGS = {"chunked": ["--attn-chunk-size", "64", "--rotary-embeddings"]}


@pytest.mark.slow
@pytest.mark.parametrize("case", [(name, HALF_PRECISION_FLAGS.get(name, []))
                                  for name in sorted(LAYER_BIASES) + sorted(VISIBILITY_RULES)]
                         + [("alibi", ["--dape", "mlp"]), ("kerple_log", ["--dape", "conv"])], ids=method_id)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_at_long_lengths_is_finite_and_close(case, dtype):
    kernel, flags = case
    torch.manual_seed(0)
    model = tiny_model(kernel, *flags).eval()
    tokens = tokens_of(1, 2048)
    with torch.no_grad():
        full = torch.log_softmax(model(tokens)[0].float(), dim=-1)
        half = torch.log_softmax(model.to(dtype)(tokens)[0].float(), dim=-1)
    assert torch.isfinite(half).all()
    assert (half - full).abs().mean() < 0.05


@pytest.mark.parametrize("flags, message", [
    (["--bias-kernel", "fire", "--fire-mlp-width", "0"], "--fire-mlp-width must be >= 1"),
    (["--bias-kernel", "fire", "--fire-threshold", "-1"], "--fire-threshold must be >= 0"),
    (["--bias-kernel", "fox", "--rotary-embeddings"], "--bias-kernel fox already encodes position"),
])
def test_bad_options_are_clear_errors(flags, message):
    with pytest.raises(KernelConfigError, match=message):
        tiny_model(*flags[1:2], *flags[2:])


def test_fire_keeps_frozen_blocks_and_notices_new_parameter_values():
    torch.manual_seed(0)
    fire = FireBias(2, 8, fire_threshold=4.0)
    block = QueryBlock(0, 16, 0, 16, 0)
    with torch.no_grad():
        first = fire.block_bias(block, 0, None)
        assert fire.block_bias(block, 0, None) is first, "kept while frozen"
        fire.out.bias.add_(1.0)  # as an optimiser writes
        moved = fire.block_bias(block, 0, None)
    torch.testing.assert_close(moved, first + 1.0)
    assert fire.block_bias(block, 0, None).requires_grad, "training computes every block, with its gradient"
    with torch.no_grad():
        large = QueryBlock(0, 1024, 0, 2048, 1024)
        assert fire.block_bias(large, 0, None) is not fire.block_bias(large, 0, None), "large blocks are not kept"


@pytest.mark.parametrize("name", sorted(LAYER_BIASES))
def test_each_layer_bias_laid_out_is_its_term_read_cell_by_cell(name):
    """A layer bias is defined once, as FlexAttention's term of a cell's indices; the laid-out block the
    other backends take is that term at every cell (FIRE lays it out by its MLP, which must agree)."""
    torch.manual_seed(1)
    heads, embed, batch = 3, 8, 2
    bias = build_layer_bias(name, heads, embed, parse_model_args(
        "transformer_lm_kerple", "--attn-chunk-size", "5", "--tokens-per-sample", "16"))
    with torch.no_grad():
        for p in bias.parameters():
            p.normal_()
    x = torch.randn(20, batch, embed)
    state = bias.key_state(x, None)
    # a call of 12 queries after 8 cached keys; its queries 3..10 against keys 2..18
    block = QueryBlock(3, 11, 2, 19, 9)
    first_position = 8
    laid_out = bias.block_bias(block, first_position, state)
    term = bias.score_term(block, first_position, state)
    for b in range(batch):
        for h in range(heads):
            for t in range(block.num_queries):
                for s in range(block.num_keys):
                    if block.offset + t - s < 0:
                        continue  # a future key: masked by the causal mask, whatever the bias says
                    cell = term(*(torch.tensor(i) for i in (b, h, t, s)))
                    expected = laid_out[b, h, t, s] if laid_out.dim() == 4 else laid_out[h, t, s]
                    torch.testing.assert_close(cell, expected, rtol=1e-5, atol=1e-5)
