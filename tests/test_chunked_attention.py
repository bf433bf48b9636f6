"""Chunked attention (``--bias-kernel chunked``, Llama 4's): the mask against its definition by loops, a chunk
scored as the same model scores that chunk alone, every backend equal to the explicit path, the combinations it
refuses, and padded queries that see no key (half precision at long lengths: test_layer_biases.py)."""

import math
from argparse import Namespace

import pytest
import torch

from kerple_core.attention.blocks import query_blocks
from kerple_core.attention.distance_bias import DistanceBias
from kerple_core.kernels import build_kernel
from kerple_core.visibility import Visibility, build_visibility_rule
from kerple_fairseq.errors import KernelConfigError

from helpers import tiny_model
from test_layer_biases import log_probs, tokens_of

CHUNK = 8


def chunk_mask_by_loops(chunk, window, first_position, block):
    """``[queries, keys]``: 0 where the key is not after the query, within the window, and in the query's chunk
    of absolute positions, else -inf (float64)."""
    rows = []
    for t in range(block.num_queries):
        i = first_position + block.query_start + t
        row = []
        for s in range(block.num_keys):
            distance = block.offset + t - s
            j = i - distance
            seen = distance >= 0 and (not window or distance < window) and math.floor(i / chunk) == math.floor(j / chunk)
            row.append(0.0 if seen else -math.inf)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float64)


@pytest.mark.parametrize("first_position", [0, 5, 13])
@pytest.mark.parametrize("block_size, window", [(0, 0), (4, 0), (4, 6)])
def test_the_mask_is_the_definition_and_blocks_read_no_earlier_chunk(first_position, block_size, window):
    visibility = Visibility(window=window, rules=(build_visibility_rule("chunked", Namespace(attn_chunk_size=5)),))
    bias = DistanceBias(build_kernel("none", 3), visibility)
    num_queries = 11
    # the call's queries are the last of its keys: key 0 at absolute position 0, query 0 at first_position
    for block in query_blocks(num_queries, first_position + num_queries, block_size, visibility):
        first_query = first_position + block.query_start
        assert block.key_start == max(first_query - first_query % 5, first_query - window + 1 if window else 0)
        view = bias.for_block(block, first_position + num_queries, shared=False, first_query=first_query)
        out = view.mask(torch.float32, "cpu")
        assert out.shape == (3, block.num_queries, block.num_keys) and out.dtype == torch.float32
        expected = chunk_mask_by_loops(5, window, first_position, block)
        for head in range(3):
            torch.testing.assert_close(out[head].double(), expected, rtol=0, atol=0)


@pytest.mark.parametrize("rotary", [False, True], ids=["nope", "rotary"])
def test_each_chunk_is_scored_as_the_model_scores_that_chunk_alone(rotary):
    """An independent reference: with no absolute positions, a query that sees only its chunk's keys (in every
    layer) computes what the same weights compute on the chunk's tokens alone, without chunks."""
    extra = ["--rotary-embeddings"] if rotary else []
    torch.manual_seed(0)
    chunked = tiny_model("chunked", "--attn-chunk-size", str(CHUNK), *extra).double().eval()
    whole = tiny_model("none", *extra).double().eval()
    whole.load_state_dict(chunked.state_dict())
    tokens = tokens_of(2, 30)
    scored = log_probs(chunked, tokens)
    for start in range(0, 30, CHUNK):
        alone = log_probs(whole, tokens[:, start:start + CHUNK])
        torch.testing.assert_close(scored[:, start:start + CHUNK], alone, rtol=0, atol=1e-10)
    assert (scored - log_probs(whole, tokens)).abs().max() > 1e-3, "chunks change the result"


@pytest.mark.parametrize("backend", ["sdpa"])  # FlexAttention: tests/test_flex_attention.py (FLEX_METHODS)
def test_every_backend_equals_the_explicit_path(backend):
    torch.manual_seed(0)
    explicit = tiny_model("chunked", "--attn-chunk-size", str(CHUNK), "--rotary-embeddings",
                          "--attention-backend", "explicit").eval()
    other = tiny_model("chunked", "--attn-chunk-size", str(CHUNK), "--rotary-embeddings",
                       "--attention-backend", backend).eval()
    other.load_state_dict(explicit.state_dict())
    tokens = tokens_of(2, 40)
    torch.testing.assert_close(log_probs(other, tokens), log_probs(explicit, tokens), rtol=0, atol=1e-5)


def test_a_plan_puts_chunks_in_the_rotary_layers_only():
    """Llama 4's iRoPE: rotary layers with chunked attention and a global NoPE layer."""
    model = tiny_model("none", "--decoder-layers", "4", "--layer-positions", "rotary+chunked,rotary+chunked,nope",
                       "--attn-chunk-size", str(CHUNK))
    layers = [layer.self_attn for layer in model.decoder.layers]
    assert [a.setup.rotary is not None for a in layers] == [True, True, False, True]
    chunks = [[rule.chunk_size for rule in a.setup.visibility.rules] for a in layers]
    assert chunks == [[CHUNK], [CHUNK], [], [CHUNK]] and all(a.layer_bias is None for a in layers)


@pytest.mark.parametrize("flags, message", [
    (["--attn-chunk-size", "0"], "--attn-chunk-size must be >= 1"),
    (["--ssmax"], "--ssmax counts the keys each query sees, which chunked attention limits by position"),
])
def test_bad_combinations_are_clear_errors(flags, message):
    with pytest.raises(KernelConfigError, match=message):
        tiny_model("chunked", *flags)


@pytest.mark.parametrize("flags", [["chunked", "--attn-chunk-size", "4"], ["none", "--attn-window", "2"]],
                         ids=["chunk", "window"])
def test_a_padded_query_that_sees_no_key_leaves_the_gradients_finite(flags):
    """In a right-padded batch (fairseq's --sample-break-mode eos), a padded query at the start of a chunk (or
    whose window holds only padding) sees no key: it attends to nothing, and the gradients stay finite."""
    torch.manual_seed(0)
    model = tiny_model(*flags).train()
    tokens = tokens_of(2, 16)
    tokens[1, 9:] = model.decoder.padding_idx  # padded queries 12..15 see only padded keys (chunk 12..15)
    logits = model(tokens)[0]
    real = tokens.ne(model.decoder.padding_idx)
    torch.log_softmax(logits[real].double(), dim=-1).mean().backward()
    assert torch.isfinite(logits[real]).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
