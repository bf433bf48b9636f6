"""Every method's model is ready for a GPU, checked without one (every kernel, layer bias, attention
method and rotary variant, the layouts): training steps (forward, loss, backward, fairseq's Adam) and
incremental decoding with beam search's reordering run on fake tensors
(``FakeTensorMode``) of a device other than the CPU, under a watch that fails the test on a tensor of
the wrong device and on every wait of the host for the device: a value read on the host (``.item()``,
``int()``, ``bool()``, ``.tolist()``), a shape that depends on values, a copy between host and device.
The host reads that remain (stock fairseq's padding check; in decoding, the plugin's cached position
and the keys of its caches of frozen parameters) are answered at their source lines, and must occur.

The device is ``meta``, not ``cuda``: on a CPU-only PyTorch (2.13) fake CUDA tensors can be made, but
indexing one asks for the CUDA device guard, which such a build lacks ("PyTorch is not linked with
support for cuda devices"; ``FakeTensorMode`` installs a fake guard only in CUDA builds), and autograd
then aborts the process; with a fake guard compiled in, backward still asks for the current CUDA stream
("Cannot access accelerator device when none is available"). ``FakeTensorMode`` propagates ``meta`` as
it would ``cuda``: an operator mixing it with a CPU tensor raises (0-dim CPU tensors excepted, as on
CUDA). What only CUDA chooses is not reached: FlexAttention's kernel (attention's ``auto`` backend on
CUDA), SDPA's kernel selection, fused or capturable optimisers; what FlexAttention is given (its block
mask, its score modifications evaluated on every cell) is checked here too.
"""

import contextlib
import traceback
from pathlib import Path
from typing import Tuple

import pytest
import torch
import torch.nn.functional as F
from fairseq.logging import metrics
from fairseq.optim.adam import Adam
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from helpers import VOCAB, tiny_model
from kerple_core.attention import flex
from kerple_core.attention.methods import ATTENTION_METHODS
from kerple_core.kernels import kernel_names

DEVICE = torch.device("meta")
TRAIN_LENGTH = 16  # --tokens-per-sample: the batch is longer, so that rotary scalings act
BATCH, LENGTH, DECODING_STEPS = 3, 24, 6

METHODS = [[kernel, *(["--attn-window", "8"] if kernel == "window" else [])] for kernel in kernel_names()] + [
    ["alibi_rf", "--alibi-rf-learnable-rho"],
    ["kerple_log", "--kernel-parameterization", "softplus"],
    ["kerple_log", "--attn-window", "8", "--attention-block-size", "8"],
    ["alibi", "--max-cache-window", "4"],
    ["fire"], ["fox"], ["fox_bias_only"],
    ["alibi", "--dape", "mlp"], ["kerple_log", "--dape", "conv"],
    ["kerple_log", "--cope"],
    ["none", "--rotary-embeddings"],
    ["none", "--rotary-embeddings", "--rotary-xpos"],
    ["none", "--rotary-embeddings", "--rotary-scaling", "ntk", "--rotary-scaling-length", "32"],
    ["none", "--rotary-embeddings", "--rotary-scaling", "dynamic-ntk", "--dynamic-ntk-step", "4"],
    ["none", "--rotary-embeddings", "--rotary-scaling", "yarn", "--rotary-scaling-length", "32"],
    ["none", "--rotary-embeddings", "--rotary-scaling", "rerope"],
    ["none", "--rotary-embeddings", "--rotary-scaling", "leaky-rerope"],
    ["none", "--rotary-embeddings", "--rotary-fraction", "0.25"],
    ["none", "--rotary-embeddings", "--ssmax"],
    ["none", "--layer-positions", "rotary@8,nope"],
    ["none", "--layer-positions", "rotary@8,nope", "--swan-scaling"],
    ["none", "--layer-positions", "rotary+chunked,nope", "--attn-chunk-size", "8", "--attn-temperature-tuning"],
] + [["none", *flags] for method in ATTENTION_METHODS.values() for flags in method.command_lines().values()]

# The host reads that remain, by (file, source line); fake tensors hold no values, so the test answers them.
#: stock fairseq's TransformerDecoder: whether the batch has padding (none has here), at every forward
PADDING_CHECK = ("fairseq/models/transformer/transformer_decoder.py",
                 "if self.cross_self_attention or prev_output_tokens.eq(self.padding_idx).any():")

#: the one host read of a training step and of a decoding step: stock fairseq's (a kept bias is keyed on
#: versions, never on values read from the device: kerple_core/attention/frozen.py)
ANSWERS = {PADDING_CHECK: False}

TORCH = Path(torch.__file__).resolve().parent
THIS_FILE = Path(__file__).resolve()


def mixes_devices(error: RuntimeError) -> bool:
    """``FakeTensorMode``'s refusal of an operator given two devices: ``FakeTensorDeviceMismatchError``
    from torch 2.12 on, a plain ``RuntimeError`` before (the GPU image's torch 2.11)."""
    mismatch = getattr(fake_tensor, "FakeTensorDeviceMismatchError", ())
    return isinstance(error, mismatch) or "Unhandled FakeTensor Device Propagation" in str(error)


class DeviceWatch(TorchDispatchMode):
    """Runs above ``FakeTensorMode`` and fails, recording it in ``failures`` by source line (so that it
    is seen even where the model catches the exception): a host read of a device value, a shape that
    depends on values, an operator mixing devices, a copy between host and device, a tensor that is not
    fake (host data made into a device tensor, or a module attribute that did not move with the model).
    A host read at a line of ``answers`` gets the answer given there and is recorded in ``answered``."""

    own_frames = {"__torch_dispatch__", "where", "fail"}

    def __init__(self, answers):
        super().__init__()
        self.answers = dict(answers)
        self.answered, self.failures = set(), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            site = self.where()
            if site in self.answers:
                self.answered.add(site)
                return self.answers[site]
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        # torch.tensor(data) on the host is lifted into the fake mode; made on the device, it stays real
        lifted = func in FakeTensorMode.lift_fns and tensors[0].device.type == "cpu"
        if not lifted and not all(isinstance(t, FakeTensor) for t in tensors):
            self.fail(f"{func} of a real tensor: host data made into a device tensor, or a tensor that did not "
                      "move with the model")
        if copies_between_host_and_device(func, args, kwargs):
            self.fail(f"{func}: a copy between host and device memory")
        try:
            return func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException) as error:
            self.fail(f"{type(error).__name__}: {error}")
        except RuntimeError as error:
            if mixes_devices(error):
                self.fail(f"{type(error).__name__}: {error}")
            raise

    def where(self) -> Tuple[str, str]:
        """(file, source line) of the innermost frame outside torch and the watch: the line that asked;
        a file of kerple_fairseq or fairseq from its package on."""
        for frame in reversed(traceback.extract_stack()):
            path = Path(frame.filename).resolve()
            if TORCH in path.parents or (path == THIS_FILE and frame.name in self.own_frames):
                continue
            for package in ("kerple_fairseq", "fairseq"):
                if package in path.parts:
                    return "/".join(path.parts[path.parts.index(package):]), frame.line
            return path.name, frame.line
        return "?", ""

    def fail(self, what):
        file, line = self.where()
        self.failures.append(f"{file}: {line}: {what}")
        raise AssertionError(self.failures[-1])


def copies_between_host_and_device(func, args, kwargs) -> bool:
    if func is torch.ops.aten._to_copy.default:
        source, target = args[0].device, kwargs.get("device", args[0].device)
    elif func is torch.ops.aten.copy_.default:
        source, target = args[1].device, args[0].device
    else:
        return False
    return {source.type, torch.device(target).type} == {"cpu", DEVICE.type}


def fake_model(flags):
    """The tiny model of ``flags`` with fake tensors on ``DEVICE``, and their mode."""
    torch.manual_seed(0)
    model = tiny_model(*flags, "--tokens-per-sample", str(TRAIN_LENGTH))
    mode = FakeTensorMode()

    def to_fake_device(tensor):
        with mode:
            return mode.from_tensor(tensor).to(DEVICE)

    model._apply(to_fake_device)
    assert all(isinstance(t, FakeTensor) and t.device == DEVICE for t in [*model.parameters(), *model.buffers()])
    return model, mode


def tokens(batch, length):
    """Token ids past the dictionary's special symbols: no padding."""
    return torch.randint(4, VOCAB + 4, (batch, length), device=DEVICE)


def train_step(model, optimizer, batch):
    model.train()  # as fairseq's trainer, at every step
    optimizer.zero_grad()
    logits, _ = model(batch[:, :-1])
    F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum").backward()
    optimizer.step()


def decode(model, steps, watch):
    """What fairseq's SequenceGenerator asks of the model for ``steps`` tokens of a beam: the model on
    every token so far with the cache, the log-probabilities of the next, the cache reordered as the
    beam's hypotheses are; returns the cache."""
    cache = {}
    prefix = torch.full((BATCH, 1), model.decoder.dictionary.eos(), device=DEVICE)
    order = torch.arange(BATCH - 1, -1, -1, device=DEVICE)
    for _ in range(steps):
        logits, extra = model(prefix, incremental_state=cache)
        log_probs = model.get_normalized_probs((logits, extra), log_probs=True)[:, -1]
        model.decoder.reorder_incremental_state_scripting(cache, order)
        prefix = torch.cat([prefix[order], log_probs[order].argmax(-1, keepdim=True)], dim=1)
    return cache


def method_id(flags):
    return "-".join(flag.lstrip("-") for flag in flags)


@pytest.mark.parametrize("flags", METHODS, ids=method_id)
def test_training_steps_stay_on_the_device_and_never_wait_for_it(flags):
    model, mode = fake_model(flags)
    optimizer = Adam(model.parameters(), lr=1e-3)  # fairseq's: fairseq-train's on a GPU without apex
    watch = DeviceWatch(ANSWERS)
    # the decoder logs a learnable kernel's parameters: into this test's own aggregator
    with mode, watch, metrics.aggregate(new_root=True):
        batch = tokens(BATCH, LENGTH + 1)
        for _ in range(2):  # the second after an update, with the optimiser's state
            train_step(model, optimizer, batch)
    assert watch.failures == []
    assert watch.answered == set(ANSWERS)
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    assert state and all(t.device == DEVICE for t in state)
    assert all(p.grad.device == DEVICE if p.requires_grad else p.grad is None for p in model.parameters())  # held: none


@pytest.mark.parametrize("flags", METHODS, ids=method_id)
def test_incremental_decoding_stays_on_the_device(flags):
    model, mode = fake_model(flags)
    model.eval()
    watch = DeviceWatch(ANSWERS)
    with mode, watch, torch.no_grad():
        cache = decode(model, DECODING_STEPS, watch)
    assert watch.failures == []
    assert watch.answered == set(ANSWERS)
    layers = [state for state in cache.values() if "prev_key" in state]
    kept = min(DECODING_STEPS, model.decoder.setup.visibility.cache or DECODING_STEPS)
    assert len(layers) == len(model.decoder.layers) and all(s["prev_key"].size(2) == kept for s in layers)
    assert all(t.device == DEVICE for state in layers for t in state.values() if isinstance(t, torch.Tensor))
    assert all(state["positions_seen"] == DECODING_STEPS for state in layers), "a host int, not a tensor"


OFFENCES = {
    "item": lambda x: x.sum().item(),
    "bool": lambda x: bool(x.sum()),
    "tolist": lambda x: x.tolist(),
    "shape from values": lambda x: x[x > 0],
    "CPU tensor": lambda x: x + torch.ones(3),
    "copy to the device": lambda x: x + torch.ones(3).to(x.device),
    "host data made on the device": lambda x: x + torch.tensor([1.0, 2.0, 3.0], device=x.device),
    "copy to the host": lambda x: x.cpu(),
}


@pytest.mark.parametrize("offence", OFFENCES)
def test_the_watch_fails_every_offence_even_where_the_exception_is_caught(offence):
    watch = DeviceWatch({})
    with FakeTensorMode(), watch, contextlib.suppress(Exception):
        OFFENCES[offence](torch.ones(3, device=DEVICE))
    assert len(watch.failures) == 1 and watch.failures[0].startswith(f'test_gpu_ready.py: "{offence}": lambda')


FLEX_METHODS = [["alibi"], ["kerple_bias_wht"], ["kerple_log", "--attn-window", "8"], ["fire"], ["fox"]]


@pytest.mark.parametrize("flags", FLEX_METHODS, ids=method_id)
def test_what_flex_attention_is_given_is_made_on_the_device_without_host_reads(flags):
    """Each block's block mask (with padded keys) and score modification, the latter evaluated on
    every cell as FlexAttention's kernel does, in training (autograd on)."""
    model, mode = fake_model(flags)
    attention = model.decoder.layers[0].self_attn
    watch = DeviceWatch({})
    with mode, watch:
        x = torch.randn(LENGTH, BATCH, model.decoder.embed_dim, device=DEVICE)
        q, k, v = attention._project(x)
        state = None if attention.layer_bias is None else attention.layer_bias.key_state(x, None)
        padding = torch.zeros(BATCH, LENGTH, dtype=torch.bool, device=DEVICE)
        with model.decoder.attention_bias.forward_scope():
            for bias in attention._block_biases(q, LENGTH, False, 0, state, recorded=True):
                block = bias.block
                mask = bias.block_mask(DEVICE, padding[:, block.key_start:block.key_end])
                score_mod = flex.masked(bias.score_mod(q.dtype, DEVICE), mask.visible)
                cells = [torch.arange(n, device=DEVICE).view(*[-1 if i == axis else 1 for i in range(4)])
                         for axis, n in enumerate((BATCH, q.size(1), block.num_queries, block.num_keys))]
                logits = score_mod(torch.zeros(BATCH, q.size(1), block.num_queries, block.num_keys,
                                               device=DEVICE), *cells)
                assert logits.shape == (BATCH, q.size(1), block.num_queries, block.num_keys)
    assert watch.failures == []
