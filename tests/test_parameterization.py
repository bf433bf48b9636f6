"""How learnable kernel parameters are kept in their domain (``--kernel-parameterization clamp`` as
KERPLE's reference code, or ``softplus``), checkpoints saved before that option and before T5's
scale existed, T5 as KERPLE's T5 baseline, and kernels computing in the precision asked of them."""

import argparse
import math
from pathlib import Path

import pytest
import torch
from fairseq import checkpoint_utils
from omegaconf import OmegaConf

from kerple_fairseq import KernelConfigError
from kerple_fairseq.analysis.kernel_curves import load_kernel
from kerple_core.attention.distance_bias import DistanceBias
from kerple_core.kernels import KERNELS, build_kernel
from kerple_core.kernels.learnable import LearnableKernel

import reference
from helpers import tiny_model

LEGACY = Path(__file__).parent / "data" / "legacy-checkpoints"
HEAD_DIM = 16
#: every kernel with constrained parameters, with the options that make them learnable
CONSTRAINED = {name: {"alibi_rf_learnable_rho": True} if name == "alibi_rf" else {}
               for name, cls in sorted(KERNELS.items()) if issubclass(cls, LearnableKernel)}
PARAMETERIZATIONS = ["clamp", "softplus"]


def make(name, heads, **options):
    return build_kernel(name, heads, argparse.Namespace(**{**CONSTRAINED.get(name, {}), **options}), head_dim=HEAD_DIM)


def set_stored(kernel, values_by_name):
    """Write ``values_by_name[name]`` (per head) into the stored tensor of each parameter, as an optimiser would."""
    suffix = kernel.parameterization.suffix
    with torch.no_grad():
        for name, values in values_by_name.items():
            getattr(kernel, name + suffix).copy_(torch.tensor(values, dtype=getattr(kernel, name + suffix).dtype))


def out_of_box(kernel):
    """Per parameter, stored values below the floor, on it, inside, and above the upper bound (or far up)."""
    floor = kernel.floor
    return {name: [-3.0, floor / 2, floor, 0.7, high + 1.5 if math.isfinite(high) else 40.0]
            for name, high in kernel.upper_bounds.items()}


def outputs(kernel, distances):
    bias = kernel(distances)
    return torch.cat([bias, kernel.weight(distances)]) if kernel.has_weight else bias


def test_every_learnable_kernel_is_constrained_and_takes_both_parameterizations():
    assert set(CONSTRAINED) == {"alibi_rf", "gauss_bias2", "gauss_bias3", "gauss_wht1", "gauss_wht2",
                                "kerple_bias_wht", "kerple_log", "kerple_log3", "kerple_power"}
    for name in CONSTRAINED:
        assert make(name, 2).parameterization.name == "clamp", "clamp is the default"
        softplus = make(name, 2, kernel_parameterization="softplus")
        assert all(n.endswith("_raw") for n, _ in softplus.named_parameters())
    with pytest.raises(KernelConfigError, match="--kernel-parameterization must be one of clamp, softplus"):
        make("kerple_log", 2, kernel_parameterization="sigmoid")


@pytest.mark.parametrize("name", CONSTRAINED)
def test_clamp_forward_is_the_formula_at_the_clamped_values(name):
    kernel = make(name, 5)
    stored = out_of_box(kernel)
    set_stored(kernel, stored)
    for param, high in kernel.upper_bounds.items():
        expected = [min(max(v, kernel.floor), high) for v in stored[param]]
        torch.testing.assert_close(kernel.value(param), torch.tensor(expected), rtol=0, atol=0)
    distances = [0, 1, 2, 7, 100, 3000]
    bias_fn, weight_fn = reference.reference_functions(kernel, CONSTRAINED[name])
    d = torch.tensor(distances, dtype=torch.float32)
    reference.assert_matches(kernel(d), reference.per_head(5, distances, bias_fn))
    if weight_fn is not None:
        reference.assert_matches(kernel.weight(d), reference.per_head(5, distances, weight_fn))


@pytest.mark.parametrize("name", CONSTRAINED)
def test_clamp_gradient_passes_straight_through_inside_and_outside_the_box(name):
    """KERPLE's reference clamps the half-precision copy the forward reads, so the gradient is the
    one at the clamped value, and it reaches the fp32 master copy wherever that lies."""
    torch.manual_seed(0)
    distances = torch.arange(0, 60, dtype=torch.float64)
    outside = make(name, 5).double()
    set_stored(outside, out_of_box(outside))
    at_clamped = make(name, 5).double()
    set_stored(at_clamped, {n: v.tolist() for n, v in outside.values().items()})
    probe = torch.randn_like(outputs(outside, distances))
    grads = []
    for kernel in (outside, at_clamped):
        (outputs(kernel, distances) * probe).sum().backward()
        grads.append({n: p.grad for n, p in kernel.named_parameters()})
    for param in grads[0]:
        torch.testing.assert_close(grads[0][param], grads[1][param], rtol=1e-12, atol=0)
        assert (grads[0][param] != 0).any(), f"{param}: no gradient reaches the stored values"
    # the fused attention gradient's per-distance tangents agree with it outside the box too
    if outside.per_head_parameters and not outside.has_weight:
        tangents = DistanceBias(outside).tangents(60)
        for index, (param, p) in enumerate(outside.named_parameters()):
            jacobian = torch.autograd.functional.jacobian(
                lambda x: torch.func.functional_call(outside, {param: x}, (distances.float(),)), p.detach())
            torch.testing.assert_close(tangents[index], torch.einsum("hdh->hd", jacobian), msg=param)


@pytest.mark.parametrize("name", CONSTRAINED)
def test_softplus_gradient_is_the_value_gradient_times_the_maps_slope(name):
    torch.manual_seed(1)
    distances = torch.arange(0, 60, dtype=torch.float64)
    softplus = make(name, 5, kernel_parameterization="softplus").double()
    clamp = make(name, 5).double()
    set_stored(clamp, {n: v.tolist() for n, v in softplus.values().items()})  # the same values, inside the box
    probe = torch.randn_like(outputs(softplus, distances))
    for kernel in (softplus, clamp):
        (outputs(kernel, distances) * probe).sum().backward()
    for param, high in softplus.upper_bounds.items():
        raw = getattr(softplus, param + "_raw").detach()
        if math.isinf(high):  # d(floor + softplus(x))/dx = sigmoid(x)
            slope = torch.sigmoid(raw)
        else:  # d(floor + (high - floor) sigmoid(x))/dx
            slope = (high - softplus.floor) * torch.sigmoid(raw) * torch.sigmoid(-raw)
        torch.testing.assert_close(getattr(softplus, param + "_raw").grad, slope * getattr(clamp, param).grad)


@pytest.mark.parametrize("name", CONSTRAINED)
def test_clamp_starts_from_the_reference_draws_unmoved(name):
    """Stored values are exactly the initial draws, those below the floor included."""
    torch.manual_seed(5)
    softplus = make(name, 4096, kernel_parameterization="softplus")
    torch.manual_seed(5)
    clamp = make(name, 4096)
    for param, high in clamp.upper_bounds.items():
        drawn = getattr(clamp, param).detach()
        moved = softplus.value(param).detach()  # softplus cannot hold a value on a bound: it moves it inside
        inside = (drawn > 2 * clamp.floor) & (drawn < high - clamp.floor)
        torch.testing.assert_close(moved[inside], drawn[inside], rtol=1e-5, atol=1e-6)
    if name == "kerple_log":
        assert (clamp.r1 < clamp.floor).any() and (clamp.r2 < clamp.floor).any(), "U[0, 2) and U[0, 1) draws"
        assert (softplus.value("r2") >= 2 * softplus.floor - 1e-7).all()


# -------------------------------------------------------------------------------- checkpoints

def legacy_model(name):
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(LEGACY / f"{name}.pt")], arg_overrides={"data": str(LEGACY)})
    return models[0].eval(), cfg, task


@pytest.mark.parametrize("name", ["kerple_log", "kerple_power", "t5"])
def test_checkpoints_saved_before_the_options_give_the_same_log_probabilities(name):
    """Checkpoints of softplus kernels and of T5's unscaled [heads, buckets] table (see
    tests/data/legacy-checkpoints/README.md) load in stock fairseq with the current defaults and score
    as they did, also after they are saved again and reloaded. Across CPUs float32 matrix products
    round differently (about 2e-6 here), so the saved log-probabilities are matched to 1e-5; a
    parameterisation read differently moves them by orders of magnitude more. On one machine the
    re-saved model scores bit for bit as the loaded one."""
    model, cfg, task = legacy_model(name)
    saved = torch.load(LEGACY / f"{name}.log-probs.pt", weights_only=True)
    with torch.no_grad():
        log_probs = torch.log_softmax(model(saved["tokens"])[0].float(), -1)
    torch.testing.assert_close(log_probs, saved["log_probs"], rtol=0, atol=1e-5)
    kernel = model.decoder.attention_bias.kernel
    if name == "t5":
        assert kernel.scale == 1.0 and not kernel.scaled_by_sqrt_head_dim
    else:
        assert kernel.parameterization.name == "clamp"
    # saved again (the current layout) and loaded into a model built from the same options
    again = task.build_model(cfg.model).eval()
    again.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(torch.log_softmax(again(saved["tokens"])[0].float(), -1), log_probs)


def test_a_clamp_checkpoint_does_not_load_as_softplus():
    clamp = make("kerple_log", 4)
    with pytest.raises(KernelConfigError, match="saved with --kernel-parameterization clamp; load them with"):
        make("kerple_log", 4, kernel_parameterization="softplus").load_state_dict(clamp.state_dict())


@pytest.mark.parametrize("parameterization", PARAMETERIZATIONS)
def test_hostile_values_in_a_checkpoint_read_back_in_the_domain(tmp_path, parameterization):
    """Whatever an optimiser wrote into the stored tensors of a fairseq checkpoint, its effective
    values, those the model, the analyses and the training log read, lie in the domain."""
    state = checkpoint_utils.load_checkpoint_to_cpu(str(LEGACY / "kerple_power.pt"))
    prefix = "decoder.attention_bias.kernel."
    suffix = "" if parameterization == "clamp" else "_raw"
    for name in ("r1", "r2"):
        del state["model"][prefix + name + "_raw"]
        state["model"][prefix + name + suffix] = torch.tensor([-1e4, -2.0, 1e-9, 1e4])
    state["cfg"]["model"]["kernel_parameterization"] = parameterization
    state["cfg"] = OmegaConf.to_container(state["cfg"], resolve=True, enum_to_str=True)  # as fairseq saves it
    path = tmp_path / "hostile.pt"
    torch.save(state, path)
    model = checkpoint_utils.load_model_ensemble([str(path)], arg_overrides={"data": str(LEGACY)})[0][0].eval()
    kernel = model.decoder.attention_bias.kernel
    assert kernel.parameterization.name == parameterization
    for values in (load_kernel(str(path), "hostile").learned_values(), kernel.values()):
        assert values.keys() == {"r1", "r2"}
        for name, per_head in values.items():
            per_head = torch.as_tensor(per_head)
            assert (per_head >= kernel.floor).all() and (per_head <= kernel.upper_bounds[name]).all(), (name, per_head)
    tokens = torch.load(LEGACY / "kerple_power.log-probs.pt", weights_only=True)["tokens"]
    with torch.no_grad():
        assert torch.isfinite(model(tokens)[0]).all()


# -------------------------------------------------------------------------------- T5

@pytest.mark.parametrize("heads", [4, 8, 12, 16])
def test_t5_table_starts_xavier_normal_for_buckets_by_heads(heads):
    torch.manual_seed(heads)
    kernel = make("t5", heads)
    assert kernel.table.shape == (32, heads)
    xavier = math.sqrt(2.0 / (32 + heads))
    assert abs(kernel.table.std().item() / xavier - 1) < 0.10
    assert abs(kernel.table.mean().item()) < 0.3 * xavier
    normal = make("t5", heads, t5_init="normal")
    assert abs(normal.table.std().item() / 0.02 - 1) < 0.10


@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_t5_adds_sqrt_head_dim_times_the_looked_up_entry(head_dim):
    torch.manual_seed(0)
    kernel = build_kernel("t5", 8, argparse.Namespace(), head_dim=head_dim)
    per_distance = DistanceBias(kernel).per_distance(300)
    table = kernel.table.detach()
    for d in (0, 1, 15, 16, 40, 127, 128, 299):
        expected = math.sqrt(head_dim) * table[reference.t5_bucket(d)]
        torch.testing.assert_close(per_distance[:, d], expected, rtol=0, atol=0)
    unscaled = build_kernel("t5", 8, argparse.Namespace(t5_bias_scale="none"), head_dim=head_dim)
    with torch.no_grad():
        unscaled.table.copy_(table)
    torch.testing.assert_close(DistanceBias(unscaled).per_distance(300) * math.sqrt(head_dim), per_distance)
    # the model passes its head width: 32 wide, 4 heads
    assert tiny_model("t5").decoder.attention_bias.kernel.scale == math.sqrt(32 / 4)


# -------------------------------------------------------------------------------- precision

@pytest.mark.parametrize("name", sorted(KERNELS))
def test_every_kernel_computes_in_float64_when_asked(name):
    """Parameter-free kernels too: a float64 gradient or reference check must not run in float32."""
    torch.manual_seed(2)
    options = {"attn_window": 5} if name == "window" else {}
    kernel = build_kernel(name, 6, argparse.Namespace(**options), head_dim=HEAD_DIM).double()
    distances = [0, 1, 5, 33, 1000, 20000]
    bias_fn, weight_fn = reference.reference_functions(kernel, options)
    bias = kernel(torch.tensor(distances, dtype=torch.float32))
    assert bias.dtype == torch.float64
    reference.assert_matches(bias, reference.per_head(6, distances, bias_fn), rtol=1e-9, atol=1e-9)
    if weight_fn is not None:
        weight = kernel.weight(torch.tensor(distances, dtype=torch.float32))
        assert weight.dtype == torch.float64
        reference.assert_matches(weight, reference.per_head(6, distances, weight_fn), rtol=1e-9, atol=1e-9)
    assert kernel.float()(torch.tensor(distances, dtype=torch.float32)).dtype == torch.float32
    assert kernel.half()(torch.tensor(distances, dtype=torch.float32)).dtype == torch.float32
    assert "precision" not in kernel.state_dict()
