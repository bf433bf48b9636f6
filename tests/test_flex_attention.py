"""FlexAttention (``--attention-backend flex``): the same model as the explicit reference path for
every method it serves, dense, in blocks, under a window, with padded keys and decoding one token at
a time; compiled (as used) and eager. On CPU it has no backward, so these compare forwards (float32);
its gradients are checked where CUDA is (tests/test_cuda.py)."""

from contextlib import contextmanager

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from helpers import FLEX_METHODS, HEADS_OF_16, NO_FLEX_BACKWARD, flex_method_model, moved, random_tokens, tiny_model
from kerple_core.attention import flex
from kerple_core.attention.attend import choose_backend
from kerple_core.attention.backends import flex as flex_backend
from kerple_core.attention.blocks import QueryBlock
from kerple_core.attention.layer_bias import LayerBlockBias
from kerple_fairseq.errors import KernelConfigError
from kerple_fairseq.experiments.language_models import model_size_flags
from kerple_core.layer_biases import layer_bias_names
from kerple_core.visibility import Visibility
from kerple_core.visibility.chunked import ChunkedAttention

#: the fast tier: a distance kernel, a weight kernel and a layer bias on the eager kernel, one
#: method compiled (every method both ways in the slow tier)
FAST_EAGER = ["alibi", "kerple_bias_wht", "fox"]
FAST_COMPILED = ["alibi"]
TOLERANCE = dict(rtol=0, atol=2e-5)  # float32 log-probabilities


def log_probs(model, tokens, backend, **kwargs):
    model.decoder.setup.backend = backend
    with torch.no_grad():
        return torch.log_softmax(model(tokens, **kwargs)[0].double(), dim=-1)


def decoded(model, tokens, backend):
    """Log-probabilities decoding one token per step with fairseq's incremental state."""
    model.decoder.setup.backend = backend
    state, steps = {}, []
    with torch.no_grad():
        for end in range(1, tokens.size(1) + 1):
            steps.append(torch.log_softmax(model(tokens[:, :end], incremental_state=state)[0].double(), dim=-1))
    return torch.cat(steps, dim=1)


@pytest.fixture
def flex_calls(monkeypatch):
    """Count FlexAttention calls (and fail if a call is not the kind asked for)."""
    calls = []
    original = flex.attend
    monkeypatch.setattr(flex, "attend", lambda *a: calls.append(a[0].shape) or original(*a))
    return calls


@pytest.fixture
def compiled(monkeypatch):
    monkeypatch.setattr(flex, "COMPILED", True)
    # a fresh compile per test: dynamo's per-function recompile limit is never reached, and no test depends on what
    # others compiled (kept from test to test in the suite's workers, 23 kernels failed to build in one worker's
    # order: PyTorch 2.13's C++ for FlexAttention named an undeclared `cur_qSplitSize5`; 8 other orders in one
    # process built them all)
    torch._dynamo.reset()


@pytest.fixture
def eager(monkeypatch):
    monkeypatch.setattr(flex, "COMPILED", False)


VARIANTS = {
    "dense": dict(flags=["--attention-block-size", "0"], length=48),
    "blocks": dict(flags=["--attention-block-size", "16"], length=70),
    "window": dict(flags=["--attention-block-size", "16", "--attn-window", "11"], length=70),
    "padding": dict(flags=["--attention-block-size", "0"], length=40),
    "decoding": dict(flags=["--attention-block-size", "0"], length=12),
}


def cases(names, variants):
    """Every (method, variant) pair, but the window kernel's 'window' variant: the kernel sets its own
    window, so that pair is its 'dense' case."""
    return [(n, v) for n in names for v in variants if (n, v) != ("window", "window")]


def check_against_reference(name, variant, flex_calls):
    spec = VARIANTS[variant]
    model = flex_method_model(name, *spec["flags"])
    tokens = random_tokens(batch=3, length=spec["length"], seed=1)
    if variant == "decoding":
        got, expected = decoded(model, tokens, "flex"), log_probs(model, tokens, "explicit")
    elif variant == "padding":
        lengths = [40, 29, 17]  # right-padded, as fairseq batches sentences
        for row, length in enumerate(lengths):
            tokens[row, length:] = model.decoder.padding_idx
        got, expected = log_probs(model, tokens, "flex"), log_probs(model, tokens, "explicit")
        real = tokens.ne(model.decoder.padding_idx)
        got, expected = got[real], expected[real]
    else:
        got, expected = log_probs(model, tokens, "flex"), log_probs(model, tokens, "explicit")
    assert flex_calls, "FlexAttention was not used"
    torch.testing.assert_close(got, expected, **TOLERANCE)


@pytest.mark.parametrize(("name", "variant"), cases(FAST_EAGER, VARIANTS))
def test_eager_flex_equals_the_reference(name, variant, eager, flex_calls):
    check_against_reference(name, variant, flex_calls)


#: compiled on CPU, padded keys, layer biases and biases scaled row by row are not served (tests/test_cuda.py
#: checks them on CUDA)
COMPILED_VARIANTS = [v for v in VARIANTS if v != "padding"]
COMPILED_ON_CPU = [m for m in FLEX_METHODS if m not in layer_bias_names() and m != "bam-ssmax"]
OTHER_EAGER = [m for m in FLEX_METHODS if m not in FAST_EAGER]
OTHER_COMPILED = [m for m in COMPILED_ON_CPU if m not in FAST_COMPILED]


@pytest.mark.parametrize(("name", "variant"), cases(FAST_COMPILED, COMPILED_VARIANTS))
def test_compiled_flex_equals_the_reference(name, variant, compiled, flex_calls):
    check_against_reference(name, variant, flex_calls)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "variant"), cases(OTHER_EAGER, VARIANTS))
def test_eager_flex_equals_the_reference_for_every_method(name, variant, eager, flex_calls):
    check_against_reference(name, variant, flex_calls)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "variant"), cases(OTHER_COMPILED, COMPILED_VARIANTS))
def test_compiled_flex_equals_the_reference_for_every_method(name, variant, compiled, flex_calls):
    check_against_reference(name, variant, flex_calls)


def vector_widths():
    """The vector widths (bits) PyTorch's CPU compiler generates code for on this CPU, widest first
    (AVX-512's 512 and AVX2's 256 on an AVX-512 CPU; 256 alone on an AVX2 one)."""
    from torch._inductor import cpu_vec_isa
    return sorted({isa.bit_width() for isa in cpu_vec_isa.valid_vec_isa_list()}, reverse=True) or [None]


@contextmanager
def compiled_with_vectors_of(bits):
    """Compiled FlexAttention compiled afresh for ``bits``-bit vectors; fails if nothing was compiled, and no
    kernel of this vector width serves a later test."""
    torch._dynamo.reset()
    compiles = flex.compile_report()[0]
    try:
        with torch._inductor.config.patch({"cpp.simdlen": bits}):
            yield
        assert flex.compile_report()[0] > compiles, "nothing was compiled"
    finally:
        torch._dynamo.reset()


#: key counts around each vector's floats (8, 16) and the CPU kernel's 16-key micro-kernel, up to
#: FlexAttention's 128-key tile and past it (one key, a compile of its own, is decoding's first step:
#: the model tests decode from it)
KEY_COUNTS = [*range(2, 42), 47, 48, 49, 56, 63, 64, 65, 72, 88, 104, 120, 127, 128, 129, 136, 152, 264]
#: (head width, queries): the tests' models' heads of 16 and a usual 64, decoding and a block of five; 8,
#: also narrow, decoding
HEADS_AND_QUERIES = [(16, 1), (16, 5), (8, 1), (64, 1), (64, 5)]


@pytest.mark.parametrize("bits", vector_widths())
def test_compiled_flex_is_right_at_every_vector_width_of_this_cpu(bits, monkeypatch):
    """The compiled CPU kernel, as the backend calls it, against float64 attention with ALiBi's bias, at
    key counts around every vector width, in each vector width this CPU runs: PyTorch 2.13's AVX2 code
    is wrong at 8, 24, ..., 120 keys for heads under 24 dimensions, which the backend avoids
    (:func:`~kerple_core.attention.flex.widened_for_cpu`)."""
    monkeypatch.setattr(flex, "COMPILED", True)
    wrong = []
    heads = 2
    slopes = 2.0 ** (-8 * torch.arange(1, heads + 1, dtype=torch.float64) / heads)
    generator = torch.Generator().manual_seed(0)
    with compiled_with_vectors_of(bits):
        for head_dim, queries in HEADS_AND_QUERIES:
            for keys in (n for n in KEY_COUNTS if n >= queries):
                offset = keys - queries
                q, k, v = (torch.randn(1, heads, n, head_dim, generator=generator, dtype=torch.float64)
                           for n in (queries, keys, keys))
                distance = offset + torch.arange(queries)[:, None] - torch.arange(keys)[None, :]
                scores = q @ k.transpose(-1, -2) - slopes[:, None, None] * distance.clamp(min=0)
                expected = torch.softmax(scores.masked_fill(distance < 0, float("-inf")), -1) @ v
                values = -slopes[:, None].float() * torch.arange(keys + 1)
                score_mod = flex.distance_bias(values, torch.tensor([offset]))
                mask = flex.block_mask(Visibility(), queries, keys, offset, offset, "cpu")
                got = flex.attend(q.float(), k.float(), v.float(), score_mod, mask)
                error = (got.double() - expected).abs().max().item()
                if not error < 1e-5:
                    wrong.append(f"head {head_dim}, {queries} queries, {keys} keys: {error:.2g}")
    assert not wrong, f"compiled FlexAttention wrong with {bits}-bit vectors at " + "; ".join(wrong)


#: key counts of the decoding test, in turn: a prefix of one fewer, then one step and another through the cache
DECODED_KEY_COUNTS = [5, 8, 9, 16, 24, 32, 40, 56]
#: heads (of queries, keys and values) of the decoding test, and how many of them its models have
DECODED_HEADS = {8: 4, 16: 4, 32: 2, 64: 2}


@pytest.mark.parametrize("width", list(DECODED_HEADS))
@pytest.mark.parametrize("bits", vector_widths())
def test_compiled_flex_decoding_is_right_at_every_vector_width_of_this_cpu(bits, width, monkeypatch, flex_calls):
    """ALiBi's self-attention module with heads of ``width`` decoding through its cache with compiled
    FlexAttention, as the plugin decodes: at batches of one and two, for each key count ``S`` in turn, in one
    process, a prefix of ``S - 1`` tokens, then two steps of one token; each step's output against the explicit
    path over the whole sequence on the same module, in each vector width this CPU runs. With AVX-512 code,
    values of 8 at a batch of 2 were wrong from 9 keys on, and with AVX2 code queries and keys of 8 and 16 at
    8, 24, 40 and 56 keys, which the backend avoids (:func:`~kerple_core.attention.flex.widened_for_cpu`)."""
    monkeypatch.setattr(flex, "COMPILED", True)
    wrong = []
    heads = DECODED_HEADS[width]
    with compiled_with_vectors_of(bits):
        for batch in (1, 2):
            torch.manual_seed(0)
            decoder = moved(tiny_model("alibi", *model_size_flags(layers=1, width=heads * width, heads=heads,
                                                                  dropout=0.0), "--attention-block-size", "0")).decoder
            attention = decoder.layers[0].self_attn
            generator = torch.Generator().manual_seed(1)
            for keys in DECODED_KEY_COUNTS:
                x = torch.randn(keys + 1, batch, heads * width, generator=generator)
                state = {}
                with torch.no_grad():
                    decoder.setup.backend = "flex"
                    attention(x[:keys - 1], x[:keys - 1], x[:keys - 1], incremental_state=state, need_weights=False)
                    steps = [attention(x[n - 1:n], x[n - 1:n], x[n - 1:n], incremental_state=state,
                                       need_weights=False)[0][-1] for n in (keys, keys + 1)]
                    decoder.setup.backend = "explicit"
                    for n, got in zip((keys, keys + 1), steps):
                        expected = attention(x[:n], x[:n], x[:n], need_weights=False)[0][-1]
                        error = (got.double() - expected.double()).abs().max().item()
                        if not error < 1e-5:
                            wrong.append(f"batch {batch}, {n} keys: {error:.2g}")
    assert len(flex_calls) == 2 * len(DECODED_KEY_COUNTS) * 3, "every prefix and step through FlexAttention"
    assert not wrong, (f"compiled FlexAttention decoding with heads of {width} wrong with {bits}-bit vectors at "
                       + "; ".join(wrong))


def test_compiles_are_bounded_over_lengths_and_decoding(monkeypatch):
    """An evaluation at six lengths, in blocks, then decoding: a bounded number of compiles, counted."""
    monkeypatch.setattr(flex, "COMPILED", True)
    torch._dynamo.reset()
    model = flex_method_model("kerple_log", "--attention-block-size", "64")
    before = flex.compile_report()[0]
    for length in (16, 32, 64, 128, 256, 512):
        expected = log_probs(model, random_tokens(batch=1, length=length), "explicit")
        torch.testing.assert_close(log_probs(model, random_tokens(batch=1, length=length), "flex"), expected,
                                   **TOLERANCE)
    decoded(model, random_tokens(batch=2, length=6), "flex")
    count, seconds = flex.compile_report()
    assert 1 <= count - before <= 6, f"{count - before} compiles"
    assert seconds > 0


@pytest.mark.parametrize("queries, keys, offset, first_key, window, chunk", [
    (300, 300, 0, 0, 0, 0), (1, 700, 699, 0, 0, 0), (200, 520, 320, 0, 150, 0), (129, 257, 128, 0, 0, 0),
    (64, 64, 0, 0, 1, 0), (600, 600, 0, 0, 0, 200), (300, 500, 200, 100, 0, 130), (256, 700, 444, 0, 300, 256)])
def test_block_mask_is_exact_and_skips_tiles(queries, keys, offset, first_key, window, chunk):
    """The tiles of the block mask against the mask itself: a tile is listed iff some query sees some
    key in it, and full iff every query sees every key (the tiles beyond a window or of another chunk
    skipped); the mask's own size is the block's. The block's first key is at position ``first_key``."""
    rules = (ChunkedAttention(chunk),) if chunk else ()
    mask = flex.block_mask(Visibility(window=window, rules=rules), queries, keys, offset, first_key + offset,
                           "cpu").tiles
    assert mask.seq_lengths == (queries, keys)
    t, s = torch.arange(queries)[:, None], torch.arange(keys)[None, :]
    d = offset + t - s
    i, j = first_key + offset + t, first_key + s
    seen = (d >= 0) & ((d < window) if window else True) & ((i // chunk == j // chunk) if chunk else True)
    tiles = seen.new_zeros(mask.kv_num_blocks.size(-1), -(-keys // flex.BLOCK))
    full = tiles.clone()
    for qt in range(tiles.size(0)):
        for kt in range(tiles.size(1)):
            cell = seen[qt * flex.BLOCK:(qt + 1) * flex.BLOCK, kt * flex.BLOCK:(kt + 1) * flex.BLOCK]
            tiles[qt, kt], full[qt, kt] = cell.any(), cell.all()
    for qt in range(tiles.size(0)):
        partial = mask.kv_indices[0, 0, qt, :mask.kv_num_blocks[0, 0, qt]].tolist()
        complete = mask.full_kv_indices[0, 0, qt, :mask.full_kv_num_blocks[0, 0, qt]].tolist()
        assert sorted(partial + complete) == tiles[qt].nonzero().flatten().tolist()
        assert sorted(complete) == full[qt].nonzero().flatten().tolist()
    if chunk:
        assert not tiles.all(), "the tiles of other chunks are skipped"


def test_where_flex_is_chosen():
    model = tiny_model("kerple_log")
    n = flex_backend.MIN_KEYS_CPU
    bias = model.decoder.setup.bias.for_block(QueryBlock(0, n, 0, n, 0), n, shared=False)
    q = torch.zeros(1, 4, n, 8)

    def backend(q, k, dropout=0.0, bias=bias, **options):
        settings = dict(dropout=dropout, key_padding_mask=None, need_probabilities=False)
        return choose_backend(q, k, bias, **{**settings, **options})

    with torch.no_grad():
        assert backend(q, q) == "flex", "CPU evaluation with enough keys"
        assert backend(q[:, :, :n - 1], q[:, :, :n - 1]) == "sdpa", "too few keys on CPU to pay"
        assert backend(q[:, :, :100], q[:, :, :100], preference="flex") == "flex"
        assert backend(q, q, preference="sdpa") == "sdpa"
        assert backend(q, q, preference="explicit") == "explicit"
        padding = torch.zeros(1, n, dtype=torch.bool)
        assert backend(q, q, key_padding_mask=padding) == "explicit", "no compiled padding mask on CPU"
        flex.COMPILED = False
        try:
            assert backend(q, q, key_padding_mask=padding) == "flex", "the eager kernel takes padding"
        finally:
            flex.COMPILED = True
        assert backend(q, q, need_probabilities=True) == "explicit"
        assert backend(q, q, needs_scores=True) == "explicit", "DAPE, CoPE, selective attention, stick-breaking"
        assert backend(q.double(), q.double()) == "sdpa", "no float64 kernel"
        assert backend(q, q, dropout=0.1) == "sdpa", "FlexAttention has no attention dropout"
        fox = LayerBlockBias(bias, tiny_model("fox").decoder.layers[0].self_attn.layer_bias, 0, None)
        assert backend(q, q, bias=fox) == "sdpa", "no compiled layer bias on CPU"
    assert backend(q, q) == "kernel gradient", "no backward on CPU"
    assert backend(q, q, preference="flex") == "kernel gradient"
    with FakeTensorMode():  # CUDA: in training too, for any length, with heads of 16 dimensions or more
        cuda = torch.empty(1, 4, 100, 16, device=torch.device("cuda", 0))
        narrow = torch.empty(1, 4, 100, 8, device=torch.device("cuda", 0))
    # where the fused kernel serves, CUDA takes it first (tests/test_fused_attention.py); FlexAttention asked for
    assert backend(cuda, cuda, preference="flex") == "flex"
    assert backend(cuda, cuda, dropout=0.1, preference="flex") == "sdpa"
    assert backend(narrow, narrow, preference="flex") == "sdpa", "FlexAttention's CUDA kernels take 16 dimensions or more"
    fox_cuda = LayerBlockBias(bias, tiny_model("fox").decoder.layers[0].self_attn.layer_bias, 0, None)
    assert backend(cuda, cuda, bias=fox_cuda, preference="flex") == "sdpa", "no backward of a layer's own term on CUDA"
    with torch.no_grad():
        assert backend(cuda, cuda, bias=fox_cuda, preference="flex") == "flex", "a layer's own term in evaluation"
    with pytest.raises(ValueError, match="unknown attention backend"):
        backend(q, q, preference="triton")


def test_unfused_attention_is_the_explicit_backend():
    assert tiny_model("alibi", "--unfused-attention").decoder.setup.backend == "explicit"
    assert tiny_model("alibi", "--attention-backend", "sdpa").decoder.setup.backend == "sdpa"
    with pytest.raises(KernelConfigError, match="--unfused-attention is --attention-backend explicit"):
        tiny_model("alibi", "--unfused-attention", "--attention-backend", "flex")



def test_kernels_compile_one_after_another(compiled, flex_calls):
    """One compiled kernel serves ALiBi and then T5, whose per-distance values come strided from its
    bucket table (a captured tensor's strides are part of the compiled kernel)."""
    for name in ("alibi", "t5"):
        model = flex_method_model(name, "--attention-block-size", "0")
        tokens = random_tokens(batch=2, length=520, seed=4)
        torch.testing.assert_close(log_probs(model, tokens, "flex"), log_probs(model, tokens, "explicit"),
                                   **TOLERANCE)
    assert len(flex_calls) == 4


def python_floats(function, seen=None):
    """The Python floats ``function`` reads from its closure or its module's globals, following the
    functions it closes over: PyTorch 2.11's compiler passes such a float as a symbolic scalar, which
    FlexAttention's CUDA lowering rejects ("unbacked_bindings": FIRE's ``eps``, measured on an H100)."""
    seen = set() if seen is None else seen
    if id(function) in seen or not hasattr(function, "__code__"):
        return []
    seen.add(id(function))
    found = [(function.__qualname__, name) for name in function.__code__.co_names
             if isinstance(function.__globals__.get(name), float)]
    for name, cell in zip(function.__code__.co_freevars, function.__closure__ or ()):
        value = cell.cell_contents
        if isinstance(value, float):
            found.append((function.__qualname__, name))
        elif callable(value):
            found += python_floats(value, seen)
    return found


@pytest.mark.parametrize("name", list(FLEX_METHODS))
def test_score_modifications_capture_no_python_float(name, eager, monkeypatch):
    """Each method's score modification and mask, as FlexAttention receives them, read tensors and
    literals only (a float literal is a constant to the compiler; a float in a closure or a global is not)."""
    received = []
    original = flex.attend
    monkeypatch.setattr(flex, "attend", lambda q, k, v, score_mod, mask: received.append(
        (score_mod, mask.visible)) or original(q, k, v, score_mod, mask))
    log_probs(flex_method_model(name), random_tokens(batch=2, length=20), "flex")
    assert received, "FlexAttention was not used"
    for score_mod, visible in received:
        assert python_floats(score_mod) == [] and python_floats(visible) == []


@pytest.mark.parametrize("name", list(FLEX_METHODS))
def test_flex_attention_serves_on_cuda_in_training_every_term_of_positions_or_the_kernel(name, monkeypatch):
    """Asked of each block with the same query on a (fake) CUDA device: in training FlexAttention serves
    every method but those whose term reads the model's tensors (:data:`~helpers.NO_FLEX_BACKWARD`, which
    PyTorch 2.11 compiles no backward for), frozen too; a mask of positions such as chunked attention's it
    serves; without gradients, every one."""
    original = flex_backend.serves
    verdicts = []

    def asked_on_cuda(q, bias, dropout, key_padding_mask):
        with FakeTensorMode():
            on_cuda = torch.empty(q.shape, dtype=q.dtype, device="cuda")
        verdicts.append(original(on_cuda, bias, dropout, key_padding_mask))
        return original(q, bias, dropout, key_padding_mask)

    monkeypatch.setattr(flex_backend, "serves", asked_on_cuda)
    model = flex_method_model(name, *HEADS_OF_16, "--attention-dropout", "0").train()
    tokens = random_tokens(batch=2, length=24)
    model(tokens)[0].sum().backward()
    assert verdicts and set(verdicts) == {name not in NO_FLEX_BACKWARD}
    verdicts.clear()
    for p in model.decoder.layers.parameters():  # the layer biases frozen, the queries still needing gradients
        p.requires_grad_(False)
    model(tokens)[0].sum().backward()
    assert verdicts and set(verdicts) == {name not in NO_FLEX_BACKWARD}
    verdicts.clear()
    with torch.no_grad():
        model(tokens)
    assert verdicts and set(verdicts) == {True}
