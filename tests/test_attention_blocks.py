"""Attention in blocks of queries (long sequences, windows) and through PyTorch's fused attention:
the same function as one explicit L x L softmax, gradients included."""

import pytest
import torch

from helpers import VOCAB, tiny_model
from kerple_core.attention.blocks import CPU_BLOCK_SCORES, MIN_CPU_BLOCK, effective_block_size, query_blocks
from kerple_core.attention.distance_bias import DistanceBias, toeplitz
from kerple_core.visibility import Visibility

CASES = [
    ("kerple_log", []), ("kerple_power", []), ("kerple_bias_wht", []), ("alibi_rf", ["--alibi-rf-learnable-rho"]),
    ("t5", []), ("sandwich", []), ("alibi", []), ("alibi", ["--attn-window", "70"]),
    ("window", ["--attn-window", "5"]), ("kerple_log", ["--attn-window", "1"]),
    ("none", ["--rotary-embeddings", "--attn-window", "7"]),
]


def loss_and_gradients(model, tokens, targets):
    model.zero_grad()
    logits, _ = model(tokens)
    lprobs = torch.log_softmax(logits, dim=-1)
    loss = -lprobs.gather(-1, targets[..., None]).sum()
    loss.backward()
    return lprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


REFERENCE = ["--attention-block-size", "0", "--unfused-attention"]  # one L x L block, explicit softmax
VARIANTS = {"blocks": ["--attention-block-size", "16"], "fused": ["--attention-block-size", "0"],
            "unfused-blocks": ["--attention-block-size", "16", "--unfused-attention"]}


def pair(kernel, flags, variant_flags):
    """The same float64 model on the reference path and on a variant."""
    torch.manual_seed(0)
    reference = tiny_model(kernel, *flags, *REFERENCE).double()
    variant = tiny_model(kernel, *flags, *variant_flags).double()
    variant.load_state_dict(reference.state_dict())
    with torch.no_grad():  # kernel parameters away from their initial values
        for a, b in zip(reference.decoder.attention_bias.parameters(), variant.decoder.attention_bias.parameters()):
            a.add_(0.3 * torch.randn_like(a))
            b.copy_(a)
    return reference.train(), variant.train()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kernel,flags", CASES, ids=lambda c: c if isinstance(c, str) else "-".join(c) or "plain")
def test_attention_paths_equal_the_reference_with_gradients(kernel, flags, variant):
    """Blocks (no L x L bias), PyTorch's fused attention, and both, against one explicit L x L
    softmax: log-probabilities and every gradient, kernel parameters included, in float64."""
    reference, model = pair(kernel, flags, VARIANTS[variant])
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(4, VOCAB + 4, (2, 100), generator=g)
    targets = torch.randint(4, VOCAB + 4, (2, 100), generator=g)
    in_blocks = "blocks" in variant

    attended = []
    original = DistanceBias.for_block
    DistanceBias.for_block = lambda self, block, *a, **k: attended.append(block) or original(self, block, *a, **k)
    try:
        out, grads = loss_and_gradients(model, tokens, targets)
    finally:
        DistanceBias.for_block = original
    if in_blocks:
        assert len(attended) > 2 and all(b.num_queries <= 16 for b in attended), \
            "no [heads, L, L] bias is laid out on the blocked path"
    else:
        assert {(b.num_queries, b.num_keys) for b in attended} == {(100, 100)}
    expected_out, expected_grads = loss_and_gradients(reference, tokens, targets)

    # fairseq's softmax runs in float32 even in a float64 model; the fused path does not
    tolerance = 1e-10 if variant == "unfused-blocks" else 1e-6
    torch.testing.assert_close(out, expected_out, rtol=0, atol=tolerance)
    assert grads.keys() == expected_grads.keys()
    scale = max(grad.abs().max().item() for grad in expected_grads.values())  # k_proj.bias's is 0 up to rounding
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=tolerance, atol=tolerance * scale, msg=name)
    kernel_grads = [n for n in expected_grads if "attention_bias" in n]
    assert bool(kernel_grads) == any(p.requires_grad for p in reference.decoder.attention_bias.parameters())


def test_blocks_in_float32_and_half_are_close_to_one_block():
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 0.1)):
        torch.manual_seed(0)
        dense = tiny_model("kerple_log", *REFERENCE).eval().to(dtype)
        blocked = tiny_model("kerple_log", "--attention-block-size", "64").eval().to(dtype)
        blocked.load_state_dict(dense.state_dict())
        tokens = torch.randint(4, VOCAB + 4, (1, 300))
        with torch.no_grad():
            a = torch.log_softmax(dense(tokens)[0].float(), -1)
            b = torch.log_softmax(blocked(tokens)[0].float(), -1)
        assert torch.isfinite(b).all()
        assert (a - b).abs().max().item() < tolerance


def test_padding_in_blocks_equals_one_block():
    dense, blocked = pair("kerple_log", [], VARIANTS["blocks"])
    tokens = torch.randint(4, VOCAB + 4, (2, 60))
    tokens[1, -5:] = 1  # fairseq's padding symbol: keys to mask per batch element
    dense.eval(), blocked.eval()
    with torch.no_grad():
        torch.testing.assert_close(blocked(tokens)[0], dense(tokens)[0], rtol=0, atol=1e-10)


@pytest.mark.parametrize("window,length", [(1, 200), (8, 512), (100, 1000), (3000, 2500)])
def test_window_blocks_touch_only_keys_inside_the_window(window, length):
    model = tiny_model("alibi", "--attn-window", str(window), "--attention-block-size", "256")
    block = model.decoder.setup.block_size_now()
    assert block == min(256, max(window, 64))
    blocks = query_blocks(length, length, block, Visibility(window=window))
    assert [b.query_start for b in blocks] == list(range(0, length, block)) and blocks[-1].query_end == length
    for b in blocks:
        assert b.key_start == max(0, b.query_start - window + 1), "the first key the block's first query sees"
        assert b.key_end == b.query_end, "keys end with the block's last query"
        assert b.offset == b.query_start - b.key_start
        assert b.num_keys <= block + window - 1
    seen = sum(b.num_queries * b.num_keys for b in blocks)
    assert seen <= length * (block + window - 1)
    if block + window - 1 < length / 2:
        assert seen < length * length / 2, "most of the L x L scores are never computed"


@pytest.mark.parametrize("num_queries,num_keys,block_size,window", [
    (1, 1, 0, 0), (1, 300, 16, 0), (1, 300, 16, 8), (7, 40, 0, 5), (100, 100, 16, 0), (100, 130, 32, 0),
    (50, 50, 64, 0)])
def test_blocks_cover_every_query_once_and_every_key_it_may_see(num_queries, num_keys, block_size, window):
    """Dense attention, incremental decoding (queries after a cache) and long sequences: the
    blocks partition the queries, and each query's keys (causal, in its window) lie in its block's."""
    blocks = query_blocks(num_queries, num_keys, block_size, Visibility(window=window))
    assert len(blocks) == (1 if block_size == 0 or num_queries <= block_size else -(-num_queries // block_size))
    covered = []
    for b in blocks:
        for t in range(b.query_start, b.query_end):
            covered.append(t)
            position = num_keys - num_queries + t  # counted from key 0
            visible = [s for s in range(num_keys) if s <= position and (not window or position - s < window)]
            assert b.key_start <= visible[0] and visible[-1] < b.key_end
            assert b.offset + (t - b.query_start) - (visible[-1] - b.key_start) == position - visible[-1]
    assert covered == list(range(num_queries))


def test_block_size_must_not_be_negative():
    from kerple_fairseq.errors import KernelConfigError

    with pytest.raises(KernelConfigError, match="--attention-block-size must be >= 0"):
        tiny_model("alibi", "--attention-block-size", "-1")
    with pytest.raises(KernelConfigError, match="--cpu-attention-block-scores must be >= 0"):
        tiny_model("alibi", "--cpu-attention-block-scores", "-1")


@pytest.mark.parametrize("block_size,window,per_query,max_scores,expected", [
    (1024, 0, 4 * 8192, 1 << 20, 32), (1024, 0, 8 * 8192, 1 << 20, 16), (1024, 0, 64 * 8192, 1 << 20, MIN_CPU_BLOCK),
    (1024, 0, 4 * 512, 1 << 20, 512), (1024, 0, 4 * 256, 1 << 20, 1024), (1024, 0, 4 * 8192, 0, 1024),
    (0, 0, 4 * 8192, 1 << 20, 0), (256, 100, 4 * 8192, 1 << 20, 32), (256, 100, 0, 1 << 20, 100),
    (8, 0, 4 * 8192, 1 << 20, 8)])
def test_blocks_on_a_cpu_hold_at_most_the_scores_asked_for(block_size, window, per_query, max_scores, expected):
    """On a CPU a block's queries times ``scores_per_query`` (batch x heads x keys) stay within
    ``max_scores``, never below MIN_CPU_BLOCK queries nor above the block size (under its window's
    limit); one block (size 0) stays one block, and no limit (0) leaves the size as it is."""
    assert effective_block_size(block_size, window, per_query, max_scores) == expected


@pytest.mark.parametrize("flags,length,expected", [
    (["--dape", "mlp"], 1024, [CPU_BLOCK_SCORES // (4 * 1024)] * 4),  # the default, 4 heads
    (["--dape", "mlp", "--cpu-attention-block-scores", "4000"], 100, [16] * 6 + [4]),
    (["--dape", "mlp", "--cpu-attention-block-scores", "0"], 1024, [1024]),
    (["--stick-breaking", "--cpu-attention-block-scores", "4000"], 100, [16] * 6 + [4]),
    (["--cpu-attention-block-scores", "4000"], 100, [100]),  # no method on the scores
    (["--cpu-attention-block-scores", "4000", "--attention-backend", "explicit"], 100, [100])])
def test_on_a_cpu_blocks_whose_scores_a_method_works_on_are_cut(flags, length, expected):
    """Blocks of 1024 queries on a CPU: where an attention method works on their scores (DAPE's score
    transform, stick-breaking's weights), cut to at most --cpu-attention-block-scores scores (batch x
    heads x queries x keys, at least MIN_CPU_BLOCK queries); 0, or no such method, keeps them whole."""
    model = tiny_model("alibi", "--attention-block-size", "1024", *flags).eval()
    attended = []
    original = DistanceBias.for_block
    DistanceBias.for_block = lambda self, block, *a, **k: attended.append(block) or original(self, block, *a, **k)
    try:
        with torch.no_grad():
            model(torch.randint(4, VOCAB + 4, (1, length)))
    finally:
        DistanceBias.for_block = original
    layers = len(model.decoder.layers)
    assert [b.num_queries for b in attended] == expected * layers and MIN_CPU_BLOCK == 16



@pytest.mark.parametrize("query_len,key_len,offset", [(1, 1, 0), (1, 300, 299), (70, 70, 0), (130, 200, 70),
                                                     (64, 100, 0), (200, 150, 60)])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_toeplitz_layout_matches_its_definition(query_len, key_len, offset, requires_grad):
    """``out[h, t, s] = line[h, offset + t - s]`` (the future value where that is negative), in
    one contiguous tensor where no gradient is needed (non-square blocks are laid out in pieces)."""
    line = torch.randn(3, offset + query_len, dtype=torch.float64, requires_grad=requires_grad)
    out = toeplitz(line, query_len, key_len, -7.0, torch.float64, offset=offset)
    expected = torch.full((3, query_len, key_len), -7.0, dtype=torch.float64)
    for t in range(query_len):
        for s in range(key_len):
            if offset + t - s >= 0:
                expected[:, t, s] = line[:, offset + t - s].detach()
    assert torch.equal(out.detach(), expected)
    if not requires_grad:
        assert out.is_contiguous()
    else:
        weights = torch.randn(out.shape, dtype=torch.float64)
        (out * weights).sum().backward()
        expected_grad = torch.zeros_like(line)
        for t in range(query_len):
            for s in range(key_len):
                if offset + t - s >= 0:
                    expected_grad[:, offset + t - s] += weights[:, t, s]
        torch.testing.assert_close(line.grad, expected_grad)
