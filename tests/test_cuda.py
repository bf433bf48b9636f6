"""The CUDA tier (``pytest -m cuda``; scripts/gpu-check.sh runs it where a GPU is): every backend that
runs on CUDA against the float64 reference computed on the CPU, forwards and every parameter's
gradient (FlexAttention's reach the kernels' parameters through captured tensors, with atomic adds:
compared with tolerances), fp16 and bf16, decoding, and the known CUDA traps."""

import functools

import pytest
import torch

from helpers import (FLEX_METHODS, HEADS_OF_16, NO_FLEX_BACKWARD, encoding_model, every_encoding, flex_method_model,
                     random_tokens)
from kerple_core.attention.attend import attend
from kerple_core.attention.backends.sdpa import masked_sdpa_backends
from kerple_core.attention.blocks import QueryBlock
from kerple_core.attention.self_attention import recorded

pytestmark = pytest.mark.cuda

CUDA = torch.device("cuda")
BACKENDS = ["fused", "flex", "sdpa", "explicit"]
#: methods checked in half precision, at 4096 tokens and in decoding (every one in float32)
FEW = ["alibi", "kerple_log", "kerple_bias_wht", "fire", "fox"]
#: the comparison's encodings and learned positions that FLEX_METHODS lacks (the attention rules, DAPE, the
#: layouts, the rotary scalings, absolute positions), each built as the comparison builds it (an evaluation-time
#: method set in the model), and DAPE's convolution: on the backend CUDA chooses for each
ENCODINGS = {name: flags for name, flags in every_encoding().items() if name not in FLEX_METHODS}
ENCODINGS["dape_conv"] = ["--arch", "transformer_lm_kerple", "--dape", "conv"]
#: the methods each backend declines when asked for by name, which another backend then serves: FlexAttention on
#: CUDA in training a term that takes gradients; SDPA a weight kernel (its weights multiply the probabilities);
#: the fused kernel a rule of positions (chunks), FIRE's term and SSMax scaling a bias's rows
DECLINED = {"flex": NO_FLEX_BACKWARD, "sdpa": {"gauss_wht1", "gauss_wht2", "kerple_bias_wht"},
            "fused": {"chunked", "fire", "bam-ssmax"}}
#: half precision's types and the tolerances of their log-probabilities (gradients: times the largest)
HALF = [(torch.float16, 3e-2), (torch.bfloat16, 2e-1)]


def cuda_model(name, *flags):
    """``name``'s tiny model (:data:`ENCODINGS` or :data:`~helpers.FLEX_METHODS`) with heads FlexAttention
    takes on CUDA."""
    if name in ENCODINGS:
        return encoding_model(ENCODINGS[name], *HEADS_OF_16, *flags)
    return flex_method_model(name, *HEADS_OF_16, *flags)


@pytest.fixture(autouse=True)
def exact_float32():
    """float32 matmuls and convolutions in IEEE precision (no TF32), as on the CPU."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def loss_and_gradients(model, tokens, backend=None):
    """Log-probabilities and every parameter's gradient of the summed next-token log-likelihood."""
    if backend is not None:
        model.decoder.setup.backend = backend
    model.zero_grad(set_to_none=True)
    logits = model(tokens)[0]
    lprobs = torch.log_softmax(logits.double() if logits.dtype == torch.float64 else logits.float(), dim=-1)
    lprobs[:, :-1].gather(-1, tokens[:, 1:, None]).sum().backward()
    return lprobs.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@functools.lru_cache(maxsize=16)
def reference(name, length, flags):
    """The float64 CPU model on the explicit path: its log-probabilities and gradients on the tokens of
    ``length``; computed once for every backend compared with it (the backends of a method run in one
    pytest-xdist worker: :func:`by_method`)."""
    model = cuda_model(name, "--unfused-attention", *flags).double().train()
    return model, loss_and_gradients(model, random_tokens(batch=2, length=length, seed=3))


def by_method(names):
    """``names`` as parameters, grouped for pytest-xdist's ``--dist loadgroup`` by method."""
    return [pytest.param(name, marks=pytest.mark.xdist_group(name)) for name in names]


def compare(name, backend, length, dtype, *flags, tolerance):
    """``name``'s model on CUDA in ``dtype`` through ``backend`` (None: the one it chooses) against the
    float64 reference: log-probabilities within ``tolerance``, every gradient within ``tolerance`` times
    the largest."""
    flags = ("--attention-dropout", "0", *flags)  # FlexAttention has no attention dropout
    tokens = random_tokens(batch=2, length=length, seed=3)
    cpu, (expected, expected_grads) = reference(name, length, flags)
    model = cuda_model(name, *flags).train().to(CUDA, dtype)
    model.load_state_dict(cpu.state_dict())
    with recorded(model) as record:
        got, grads = loss_and_gradients(model, tokens.to(CUDA), backend)
    if backend is not None:
        served = name not in DECLINED.get(backend, ())
        assert (backend in record.backends) == served, f"asked for {backend}, attended with {dict(record.backends)}"
    torch.testing.assert_close(got.double().cpu(), expected, rtol=0, atol=tolerance)
    assert grads.keys() == expected_grads.keys()
    scale = max(g.abs().max().item() for g in expected_grads.values())
    for n, g in expected_grads.items():
        assert torch.isfinite(grads[n]).all(), n
        torch.testing.assert_close(grads[n].double().cpu(), g, rtol=0, atol=tolerance * scale,
                                   msg=lambda message, n=n: f"{n}: {message}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", by_method(FLEX_METHODS))
def test_float32_forward_and_gradients(name, backend):
    """333 tokens (not a multiple of FlexAttention's 128: its block mask has the exact length)."""
    compare(name, backend, 333, torch.float32, "--attention-block-size", "0", tolerance=2e-4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", by_method(FEW))
def test_blocks_of_a_long_sequence(name, backend):
    compare(name, backend, 4096, torch.float32, "--attention-block-size", "1024", tolerance=5e-4)


@pytest.mark.parametrize("dtype,tolerance", HALF)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", by_method(FEW))
def test_half_precision(name, backend, dtype, tolerance):
    compare(name, backend, 512, dtype, "--attention-block-size", "0", tolerance=tolerance)


@pytest.mark.parametrize("name", by_method(ENCODINGS))
def test_every_encoding_in_float32(name):
    compare(name, None, 333, torch.float32, "--attention-block-size", "0", tolerance=2e-4)


@pytest.mark.parametrize("dtype,tolerance", HALF)
@pytest.mark.parametrize("name", by_method(ENCODINGS))
def test_every_encoding_in_half_precision(name, dtype, tolerance):
    compare(name, None, 512, dtype, "--attention-block-size", "0", tolerance=tolerance)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_half_precision_is_finite_at_16k(backend, dtype):
    model = cuda_model("alibi").to(CUDA, dtype)
    model.decoder.setup.backend = backend
    with torch.no_grad():
        assert torch.isfinite(model(random_tokens(batch=1, length=16384).to(CUDA))[0]).all()


@pytest.mark.parametrize("name", [*FEW, *ENCODINGS])
def test_decoding_equals_full_scoring(name):
    """Through FlexAttention for :data:`FEW`, on the backend each chooses for :data:`ENCODINGS`."""
    model = cuda_model(name).to(CUDA)
    tokens = random_tokens(batch=2, length=20).to(CUDA)
    if name in FEW:
        model.decoder.setup.backend = "flex"
    state, steps = {}, []
    with torch.no_grad():
        full = torch.log_softmax(model(tokens)[0], dim=-1)
        for end in range(1, tokens.size(1) + 1):
            steps.append(torch.log_softmax(model(tokens[:, :end], incremental_state=state)[0], dim=-1))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", FEW)
def test_padded_keys(name):
    """Compiled FlexAttention with a padding mask (not served compiled on the CPU)."""
    model = cuda_model(name).to(CUDA)
    tokens = random_tokens(batch=3, length=300)
    for row, length in enumerate([300, 211, 77]):
        tokens[row, length:] = model.decoder.padding_idx
    tokens = tokens.to(CUDA)
    out = {}
    with torch.no_grad():
        for backend in ("flex", "explicit"):
            model.decoder.setup.backend = backend
            out[backend] = torch.log_softmax(model(tokens)[0], dim=-1)[tokens.ne(model.decoder.padding_idx)]
    torch.testing.assert_close(out["flex"], out["explicit"], rtol=0, atol=1e-4)


def test_sdpa_with_a_mask_avoids_cudnn_nan_gradients():
    """cuDNN's SDPA backend returns NaN query gradients with a mask when L % 128 == 64 and a row's
    log-sum-exp is below about -88.7 (PyTorch issue 196678): T5 buckets all at -100 put every row there."""
    length = 192
    bias = flex_method_model("t5").decoder.setup.bias
    with torch.no_grad():
        for p in bias.parameters():
            p.fill_(-100.0)
    block = bias.for_block(QueryBlock(0, length, 0, length, 0), length, shared=False)
    g = torch.Generator().manual_seed(0)
    q, k, v = (0.1 * torch.randn(1, 4, length, 8, generator=g) for _ in range(3))
    grads = {}
    for device, backend in ((torch.device("cpu"), "explicit"), (CUDA, "sdpa")):
        bias.to(device)
        q_, k_, v_ = (t.detach().clone().to(device).requires_grad_() for t in (q, k, v))
        out, _ = attend(q_, k_, v_, block, preference=backend)
        out.sum().backward()
        grads[backend] = q_.grad.cpu()
    assert torch.isfinite(grads["sdpa"]).all()
    torch.testing.assert_close(grads["sdpa"], grads["explicit"], rtol=0, atol=1e-5)


MASKED_SDPA_CASES = [pytest.param(name, dtype, backend, marks=pytest.mark.xdist_group(name),
                                  id=f"{name}-{str(dtype).split('.')[-1]}-{backend.name}")
                     for name in ("gauss_bias3", "gauss_bias2", "kerple_log")
                     for dtype in (torch.float32, torch.float16) for backend in masked_sdpa_backends(dtype)]


@pytest.mark.parametrize("name,dtype,sdpa_backend", MASKED_SDPA_CASES)
def test_each_masked_sdpa_backend(name, dtype, sdpa_backend, monkeypatch):
    """Each of SDPA's backends that the plugin allows with a mask, alone, against the float64 reference;
    a failure names every parameter off (error over tolerance) and the positions of the embeddings off."""
    from kerple_core.attention.backends import sdpa
    monkeypatch.setattr(sdpa, "masked_sdpa_backends", lambda dtype: [sdpa_backend])
    length, flags = 333, ("--attention-dropout", "0", "--attention-block-size", "0")
    tolerance = 2e-4 if dtype == torch.float32 else 3e-2
    tokens = random_tokens(batch=2, length=length, seed=3)
    cpu, (expected, expected_grads) = reference(name, length, flags)
    model = cuda_model(name, *flags).train().to(CUDA, dtype)
    model.load_state_dict(cpu.state_dict())
    got, grads = loss_and_gradients(model, tokens.to(CUDA), "sdpa")
    scale = max(g.abs().max().item() for g in expected_grads.values())
    errors = {"log-probabilities": (got.double().cpu() - expected).abs().max().item() / tolerance}
    errors.update({n: (grads[n].double().cpu() - g).abs().max().item() / (tolerance * scale)
                   for n, g in expected_grads.items()})
    off = [n for n, e in errors.items() if not e <= 1.0]
    rows = ((grads["decoder.embed_tokens.weight"].double().cpu() - expected_grads["decoder.embed_tokens.weight"])
            .abs().amax(-1) > tolerance * scale).nonzero().flatten().tolist()
    where = {row: (tokens == row).nonzero().tolist() for row in rows}
    assert not off, (f"{sdpa_backend}: off (error / tolerance): " + ", ".join(f"{n} {errors[n]:.3g}" for n in off)
                     + f"; embedding rows off {rows} at (sequence, position) {where}")


def test_blocks_of_a_method_on_the_scores_are_not_cut_on_cuda(monkeypatch):
    """--cpu-attention-block-scores is a CPU's: on CUDA, DAPE's blocks keep --attention-block-size queries."""
    from kerple_core.attention.distance_bias import DistanceBias

    model = encoding_model(ENCODINGS["dape_alibi"], *HEADS_OF_16, "--attention-block-size", "64",
                           "--cpu-attention-block-scores", "4000").to(CUDA).eval()
    attended = []
    original = DistanceBias.for_block
    monkeypatch.setattr(DistanceBias, "for_block",
                        lambda self, block, *a, **k: attended.append(block.num_queries) or original(self, block, *a, **k))
    with torch.no_grad():
        model(random_tokens(1, 100).to(CUDA))
    assert attended == [64, 36] * len(model.decoder.layers)


def test_the_benchmark_names_each_operation_that_makes_the_host_wait():
    """``scripts/benchmark.py --profile``'s host view: a value read back and a shape that depends on values are found
    at their lines; work that stays on the device, none."""
    from kerple_fairseq.experiments.benchmark import synchronising_sites

    x = torch.arange(6.0, device=CUDA)

    def waits():
        (x * 2).sum().item()
        x.nonzero()

    sites = synchronising_sites(waits)
    assert sum(sites.values()) >= 2 and all(site.startswith("test_cuda.py:") for site in sites), sites
    assert synchronising_sites(lambda: (x * 2).cumsum(0)) == {}
