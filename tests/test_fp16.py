"""fp16 training on CPU, as the recipe trains on GPUs: fairseq's fp16 optimiser (``--fp16
--fp16-no-flatten-grads``; plain ``--fp16 --cpu`` fails inside fairseq) and ``--memory-efficient-fp16``
update every learnable kernel in both parameterizations, with fp32 master weights and in-domain
effective values in the checkpoint; a half-precision forward and backward at 2048 tokens is finite."""

import math

import pytest
import torch
from fairseq.optim.fp16_optimizer import FP16Optimizer

from kerple_fairseq.analysis.kernel_curves import load_kernel
from kerple_fairseq.experiments.language_models import model_size_flags
from kerple_fairseq.experiments.recipe import CPU_FP16_FLAGS
from kerple_core.kernels import KERNELS
from kerple_core.kernels.learnable import LearnableKernel

from conftest import train_in_process
from helpers import random_tokens, tiny_model

SIZE = model_size_flags(layers=2, width=32, heads=4)
UPDATES = 4
LEARNABLE = [name for name, cls in sorted(KERNELS.items()) if issubclass(cls, LearnableKernel)]
KERNEL_FLAGS = {"alibi_rf": ["--alibi-rf-learnable-rho", "--alibi-rf-rho", "32"], "bam": ["--bam-loc-trainable"]}
RUNS = {f"{name}-{p}": ["--bias-kernel", name, *KERNEL_FLAGS.get(name, []), "--kernel-parameterization", p]
        for name in LEARNABLE for p in ("clamp", "softplus")}
RUNS["t5"] = ["--bias-kernel", "t5"]
RUNS["bam"] = ["--bias-kernel", "bam"]  # unconstrained; negative shapes overflow fp16 gradients (docs/kernels.md)
FAST = {"kerple_log-clamp"}  # in the fast tier; the others in the slow one


@pytest.fixture
def master_weights(monkeypatch):
    """The dtypes of the fp32 copies FP16Optimizer steps, and of the fp16 parameters it copies them into."""
    seen = []
    step = FP16Optimizer.step

    def recording_step(self, *args, **kwargs):
        seen.append(({p.dtype for p in self.fp32_params}, {p.dtype for p in self.fp16_params}))
        return step(self, *args, **kwargs)

    monkeypatch.setattr(FP16Optimizer, "step", recording_step)
    return seen


def check_checkpoint(path, kernel_name):
    loaded = load_kernel(str(path), "fp16")
    assert loaded.kernel.name == kernel_name
    assert all(torch.isfinite(p).all() for p in loaded.kernel.parameters())
    if not isinstance(loaded.kernel, LearnableKernel):
        return
    for name, values in loaded.learned_values().items():
        high = loaded.kernel.upper_bounds[name]
        assert all(loaded.kernel.floor <= v <= high for v in values), (name, values)


@pytest.mark.parametrize("run", [pytest.param(r, marks=() if r in FAST else pytest.mark.slow) for r in sorted(RUNS)])
def test_fp16_updates_train_every_learnable_kernel(data_bin, tmp_path, run, master_weights):
    losses = train_in_process(data_bin, tmp_path, UPDATES, "--arch", "transformer_lm_kerple", *SIZE,
                              *RUNS[run], *CPU_FP16_FLAGS)
    assert len(losses) == UPDATES and all(math.isfinite(x) for x in losses), losses
    assert len(master_weights) >= UPDATES
    assert all(fp32 == {torch.float32} and fp16 == {torch.float16} for fp32, fp16 in master_weights)
    state = torch.load(tmp_path / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    assert state["last_optimizer_state"]["loss_scale"] > 0
    check_checkpoint(tmp_path / "checkpoint_last.pt", RUNS[run][1])


@pytest.mark.slow
def test_memory_efficient_fp16_trains_too(data_bin, tmp_path):
    losses = train_in_process(data_bin, tmp_path, UPDATES, "--arch", "transformer_lm_kerple", *SIZE,
                              "--bias-kernel", "kerple_power", "--memory-efficient-fp16")
    assert len(losses) == UPDATES and all(math.isfinite(x) for x in losses), losses
    check_checkpoint(tmp_path / "checkpoint_last.pt", "kerple_power")


LONG_CASES = [(k, p) for k in LEARNABLE for p in ("clamp", "softplus")] + [("t5", "clamp"), ("alibi", "clamp"),
                                                                           ("bam", "clamp")]
FAST_LONG = {("kerple_log", "clamp"), ("kerple_power", "softplus")}  # in the fast tier; the others in the slow one


@pytest.mark.parametrize("kernel, parameterization",
                         [pytest.param(*c, marks=() if c in FAST_LONG else pytest.mark.slow) for c in LONG_CASES])
def test_fp16_forward_and_backward_at_2048_tokens_are_finite(kernel, parameterization):
    torch.manual_seed(0)
    flags = [*KERNEL_FLAGS.get(kernel, []), "--kernel-parameterization", parameterization]
    model = tiny_model(kernel, *flags).half().train()
    logits = model(random_tokens(batch=1, length=2048))[0]
    assert logits.dtype == torch.float16 and torch.isfinite(logits).all()
    logits.float().logsumexp(-1).mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    kernel_grads = [p.grad for p in model.decoder.attention_bias.kernel.parameters()]
    assert all((g != 0).any() for g in kernel_grads) or not kernel_grads
