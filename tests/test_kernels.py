"""Each kernel's ``[heads, distances]`` bias (and weight) against its independent float64 reference in
``tests/reference.py``, gradients, constraints, options and documentation."""

import argparse
import dataclasses
import math

import numpy as np
import pytest
import torch

from kerple_fairseq import KernelConfigError
from kerple_core.kernels import KERNELS, build_kernel, kernel_names
from kerple_core.kernels.alibi import alibi_slopes
from kerple_core.kernels.learnable import LearnableKernel

import reference

HEADS = [8, 12, 16]
RANGE = 4096
# float32 distances each kernel maps to [heads, len(distances)]: a contiguous range, a sparse set
# reaching far beyond T5's and Sandwich's scales, and an unordered one with a repeat
DISTANCES = {
    "range": list(range(RANGE)),
    "sparse": [0, 1, 7, 300, 4095, 20000],
    "unordered": [129, 0, 16, 3, 20000, 3],
}
# kernel name -> options other than the defaults that get their own run
VARIANTS = {
    "alibi": [{}, {"alibi_shift": 2.0}, {"alibi_equal_slope": 3.0}],
    "alibi_rf": [{}, {"alibi_rf_decay": "gaussian", "alibi_rf_rho": 9.0},
                 {"alibi_rf_decay": "reciprocal", "alibi_rf_rho": 4.0, "alibi_rf_learnable_rho": True},
                 {"alibi_rf_learnable_rho": True, "alibi_rf_rho": 20.0, "alibi_shift": -1.0}],
    "sandwich": [{}, {"sandwich_dim": 16}],
    "sandwich_smoothed": [{}, {"sandwich_dim": 32, "sandwich_fit_distances": 200}],
    "t5": [{}, {"t5_init": "normal", "t5_bias_scale": "none"}],
    # both parameterizations of an unbounded and a bounded (power) parameter, and of a weight kernel
    "kerple_log": [{}, {"kernel_parameterization": "softplus"}],
    "kerple_power": [{}, {"kernel_parameterization": "softplus"}],
    "kerple_bias_wht": [{}, {"kernel_parameterization": "softplus"}],
    # negative shapes (heads favouring distant keys), a numeric scale, a location off zero
    "bam": [{}, {"bam_shape_init": -0.5, "bam_scale_init": "5", "bam_loc_init": -1.2},
            {"bam_shape_init": 1.7, "bam_scale_init": 0.3, "bam_loc_init": 0.4, "bam_loc_trainable": True}],
}
CASES = [(name, options) for name in sorted(KERNELS) for options in VARIANTS.get(name, [{}])]
WEIGHT_KERNELS = sorted(name for name, cls in KERNELS.items() if cls.has_weight)
WEIGHT_CASES = [(name, options) for name, options in CASES if KERNELS[name].has_weight]


def config(**options):
    return argparse.Namespace(**options)


HEAD_DIM = 16  # the attention head width given to kernels that need it (t5)


def make(name, heads, options=None):
    return build_kernel(name, heads, config(**(options or {})), head_dim=HEAD_DIM)


def learnable_cases():
    return [(n, o) for n, o in CASES if list(make(n, 2, o).parameters())]


def case_id(case):
    name, options = case
    return name + "".join(f"-{k}={v}" for k, v in options.items())


def test_registry_lists_every_kernel():
    assert set(kernel_names()) == {
        "alibi", "alibi_rf", "bam", "gauss_bias2", "gauss_bias3", "gauss_wht1", "gauss_wht2", "kerple_bias_wht",
        "kerple_log", "kerple_log3", "kerple_power", "none", "sandwich", "sandwich_smoothed", "t5", "window"}
    assert WEIGHT_KERNELS == ["gauss_wht1", "gauss_wht2", "kerple_bias_wht"]


def test_every_kernel_has_one_float64_reference():
    missing = sorted(set(KERNELS) - set(reference.KERNEL_REFERENCES))
    assert not missing, f"registered kernels with no entry in tests/reference.py KERNEL_REFERENCES: {missing}"
    unknown = sorted(set(reference.KERNEL_REFERENCES) - set(KERNELS))
    assert not unknown, f"tests/reference.py has references for unregistered kernels: {unknown}"
    for name in VARIANTS:
        assert name in KERNELS, f"VARIANTS names an unregistered kernel: {name}"


def kernel_and_reference(case, heads):
    name, options = case
    torch.manual_seed(heads)
    kernel = make(name, heads, options)
    assert kernel.name == name and kernel.num_heads == heads
    return kernel, reference.reference_functions(kernel, options)


@pytest.mark.parametrize("distances", DISTANCES.values(), ids=DISTANCES.keys())
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("heads", HEADS)
def test_bias_matches_float64_reference(case, heads, distances):
    kernel, (bias_fn, _) = kernel_and_reference(case, heads)
    bias = kernel(torch.tensor(distances, dtype=torch.float32))
    assert bias.dtype == torch.float32 and bias.shape == (heads, len(distances))
    reference.assert_matches(bias, reference.per_head(heads, distances, bias_fn))


@pytest.mark.parametrize("distances", DISTANCES.values(), ids=DISTANCES.keys())
@pytest.mark.parametrize("case", WEIGHT_CASES, ids=case_id)
@pytest.mark.parametrize("heads", HEADS)
def test_weight_matches_float64_reference(case, heads, distances):
    kernel, (_, weight_fn) = kernel_and_reference(case, heads)
    assert weight_fn is not None, f"the reference of weight kernel {kernel.name} gives no weight"
    weight = kernel.weight(torch.tensor(distances, dtype=torch.float32))
    assert weight.dtype == torch.float32 and weight.shape == (heads, len(distances))
    reference.assert_matches(weight, reference.per_head(heads, distances, weight_fn))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_only_weight_kernels_have_a_weight(case):
    kernel, (_, weight_fn) = kernel_and_reference(case, 2)
    assert (weight_fn is not None) == kernel.has_weight
    if not kernel.has_weight:
        with pytest.raises(NotImplementedError, match="has no weight"):
            kernel.weight(torch.arange(3, dtype=torch.float32))


def test_alibi_slopes_for_8_heads_are_halves_to_1_over_256():
    assert alibi_slopes(8) == [1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128, 1 / 256]


@pytest.mark.parametrize("heads", [1, 2, 3, 5, 6, 12, 16, 20, 24])
def test_alibi_slopes_follow_press_rule_for_any_head_count(heads):
    np.testing.assert_allclose(alibi_slopes(heads), reference.alibi_slopes_reference(heads), rtol=1e-15)


def test_alibi_slopes_for_12_heads():
    # 8 geometric slopes 2^-1..2^-8, then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5
    expected = [2.0 ** -k for k in range(1, 9)] + [2.0 ** -(k + 0.5) for k in range(4)]
    np.testing.assert_allclose(alibi_slopes(12), expected, rtol=1e-15)


def test_alibi_shift_and_equal_slope_as_in_sandwich_section_4():
    assert make("alibi", 8, {"alibi_shift": 2.0}).slopes == [2.0 ** -(h + 2) for h in range(1, 9)]
    assert make("alibi", 8, {"alibi_shift": -1.0}).slopes == [2.0 ** -(h - 1) for h in range(1, 9)]
    assert make("alibi", 12, {"alibi_equal_slope": 0.0}).slopes == [1.0] * 12
    with pytest.raises(KernelConfigError, match="--alibi-shift and --alibi-equal-slope"):
        make("alibi", 8, {"alibi_shift": 1.0, "alibi_equal_slope": 2.0})


def test_t5_buckets_by_hand():
    """Exact below 16, 16 at d = 16 and 17, logarithmic, 31 from 128 on (T5's causal bucketing)."""
    kernel = make("t5", 2, {"t5_bias_scale": "none"})
    with torch.no_grad():
        kernel.table.copy_(torch.arange(64, dtype=torch.float32).view(2, 32).T)
    distances = torch.tensor([0, 1, 15, 16, 17, 23, 24, 64, 127, 128, 5000], dtype=torch.float32)
    expected = [0, 1, 15, 16, 16, 18, 19, 26, 31, 31, 31]
    assert kernel(distances)[0].tolist() == expected
    assert kernel(distances)[1].tolist() == [32 + b for b in expected]
    assert [reference.t5_bucket(int(d)) for d in distances] == expected


def test_sandwich_is_zero_at_distance_zero_and_compressed_per_head():
    bias = make("sandwich", 8)(torch.arange(0, 100, dtype=torch.float32))
    assert bias[:, 0].abs().max() == 0
    # c_h = 8h/H: head h's curve is head 1's divided by h
    torch.testing.assert_close(bias[3], bias[0] / 4)


def test_sandwich_smoothed_reproduces_the_papers_fit():
    """Sandwich Fig. 9: c = 8, D = 128, a whole 8192-token row: y = -0.825 log(1 + d) - 0.8."""
    kernel = make("sandwich_smoothed", 8, {"sandwich_fit_distances": 8192})
    a, b = kernel.coefficients[-1]  # head 8 of 8: c = 8
    assert abs(a - 0.825) < 0.02 and abs(b + 0.8) < 0.02, (a, b)
    # the implementation's default, the 50 nearest distances (the paper's footnote 7), fits them closer
    a50, b50 = make("sandwich_smoothed", 8).coefficients[-1]
    np.testing.assert_allclose([a50, b50], reference.sandwich_fit(8, 128, 50)[-1], rtol=1e-9, atol=1e-12)
    assert a50 > a


class BiasAndWeight(torch.nn.Module):
    """A kernel's bias, with its weight stacked below for weight kernels (one output to gradcheck)."""

    def __init__(self, kernel):
        super().__init__()
        self.kernel = kernel

    def forward(self, distances):
        bias = self.kernel(distances)
        return torch.cat([bias, self.kernel.weight(distances)]) if self.kernel.has_weight else bias


@pytest.mark.parametrize("case", learnable_cases(), ids=case_id)
def test_gradients_of_learnable_parameters(case):
    name, options = case
    torch.manual_seed(0)
    both = BiasAndWeight(make(name, 4, options)).double()
    distances = torch.arange(0, 50, dtype=torch.float64)
    names = [n for n, _ in both.named_parameters()]
    inputs = tuple(p.detach().clone().requires_grad_(True) for p in both.parameters())
    assert torch.autograd.gradcheck(
        lambda *raw: torch.func.functional_call(both, dict(zip(names, raw)), (distances,)), inputs)


@pytest.mark.parametrize("case", learnable_cases(), ids=case_id)
def test_parameters_are_per_head_and_gradients_are_finite_at_zero_distance(case):
    name, options = case
    kernel = make(name, 12, options)
    for p in kernel.parameters():  # [heads], or T5's [buckets, heads] table
        assert p.shape[0] == 12 if kernel.per_head_parameters else p.shape[-1] == 12
    distances = torch.arange(0, 10, dtype=torch.float32)
    out = kernel(distances).sum() + (kernel.weight(distances).sum() if kernel.has_weight else 0)
    out.backward()
    for p in kernel.parameters():  # a parameter held fixed (BAM's location by default) gets none
        assert (torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0) if p.requires_grad else p.grad is None


def constrained(kernel):
    return isinstance(kernel, LearnableKernel) and kernel.upper_bounds


@pytest.mark.parametrize("parameterization", ["clamp", "softplus"])
@pytest.mark.parametrize("case", [c for c in learnable_cases() if constrained(make(c[0], 2, c[1]))], ids=case_id)
def test_constraints_hold_after_optimiser_steps_pushing_out_of_domain(case, parameterization):
    name, options = case
    options = {**options, "kernel_parameterization": parameterization}
    distances = torch.arange(0, 100, dtype=torch.float32)
    lowest = math.inf
    for sign in (1.0, -1.0):  # minimise, then (from a fresh kernel) maximise the bias and weight
        torch.manual_seed(1)
        both = BiasAndWeight(make(name, 8, options))
        kernel = both.kernel
        opt = torch.optim.SGD(kernel.parameters(), lr=1e3)
        for step in range(3):
            opt.zero_grad()
            (sign * both(distances).sum()).backward()
            opt.step()
            assert all(torch.isfinite(p.grad).all() for p in kernel.parameters())
            for p, high in kernel.upper_bounds.items():
                value = kernel.value(p)
                assert (value >= kernel.floor).all() and (value <= high).all(), (p, value)
                lowest = min(lowest, value.min().item())
            assert torch.isfinite(both(distances)).all()
    # the hostile steps did drive some parameter to its lower bound
    assert lowest < 0.05


def test_reference_initialisation_ranges():
    torch.manual_seed(0)
    log = make("kerple_log", 4096)
    assert log.value("r1").max() < 2.0 and log.value("r2").max() < 1.0
    assert 0.9 < log.value("r1").mean() < 1.1 and 0.4 < log.value("r2").mean() < 0.6
    power = make("kerple_power", 4096)
    assert power.value("r1").max() < 1.0
    assert 0.4 < power.value("r1").mean() < 0.6 and 0.9 < power.value("r2").mean() < 1.1
    torch.testing.assert_close(make("kerple_log3", 16).value("r3"), torch.ones(16))
    rf = make("alibi_rf", 8, {"alibi_rf_learnable_rho": True, "alibi_rf_rho": 300.0})
    torch.testing.assert_close(rf.value("rho"), torch.full((8,), 300.0))


def test_reparameterisation_round_trips_inside_the_domain():
    from kerple_core.kernels.constraints import bounded, bounded_inverse, positive, positive_inverse

    values = torch.tensor([0.03, 0.5, 1.0, 1.9, 7.0], dtype=torch.float64)
    torch.testing.assert_close(positive(positive_inverse(values, 0.01), 0.01), values)
    inside = values[values < 1.98]
    torch.testing.assert_close(bounded(bounded_inverse(inside, 0.01, 2.0), 0.01, 2.0), inside)
    # at or beyond a bound: moved inside, never to an infinite raw value
    edge = torch.tensor([0.0, 0.01, 2.0, 5.0], dtype=torch.float64)
    assert torch.isfinite(positive_inverse(edge, 0.01)).all()
    assert torch.isfinite(bounded_inverse(edge, 0.01, 2.0)).all()


def test_unknown_kernel_is_a_clear_error():
    with pytest.raises(KernelConfigError, match="unknown bias kernel 'kerple_logg'; choose one of: alibi"):
        build_kernel("kerple_logg", 8)


@pytest.mark.parametrize("name, options, message", [
    ("kerple_log", {"kernel_param_floor": 0.0}, "--kernel-param-floor must be in"),
    ("kerple_bias_wht", {"kernel_param_floor": -1.0}, "--kernel-param-floor must be in"),
    ("gauss_wht1", {"kernel_param_floor": 1.0}, "--kernel-param-floor must be in"),
    ("sandwich", {"sandwich_dim": 127}, "--sandwich-dim must be an even number"),
    ("sandwich_smoothed", {"sandwich_fit_distances": 1}, "--sandwich-fit-distances must be at least 2"),
    ("t5", {"t5_num_buckets": 1}, "--t5-num-buckets must be at least 2"),
    ("t5", {"t5_max_distance": 16}, "--t5-max-distance must exceed half"),
    ("alibi_rf", {"alibi_rf_rho": 0.0}, "--alibi-rf-rho must be a finite number above"),
    ("alibi_rf", {"alibi_rf_decay": "cubic"}, "--alibi-rf-decay must be one of"),
    ("alibi", {"alibi_shift": math.inf}, "--alibi-shift must be a finite number"),
    ("bam", {"bam_scale_init": "wide"}, "--bam-scale-init must be slope or a finite number > 0"),
    ("bam", {"bam_scale_init": "-2"}, "--bam-scale-init must be slope or a finite number > 0"),
    ("bam", {"bam_shape_init": math.nan}, "--bam-shape-init must be a finite number"),
    ("bam", {"bam_loc_init": math.inf}, "--bam-loc-init must be a finite number"),
])
def test_out_of_range_option_is_a_clear_error(name, options, message):
    with pytest.raises(KernelConfigError, match=message):
        make(name, 8, options)


def test_bam_starts_as_alibi_up_to_a_constant_per_head():
    """The reference's initialisation (beta 1, ALiBi's slopes, location 0): ALiBi minus m_h * eps, which the
    softmax ignores (to the float32 rounding of the stored log-slope)."""
    distances = torch.arange(0, 3000, dtype=torch.float64)
    bam, alibi = make("bam", 12).double(), make("alibi", 12).double()
    slopes = torch.tensor(alibi_slopes(12), dtype=torch.float64)[:, None]
    torch.testing.assert_close(bam(distances), alibi(distances) - slopes * 1e-5, rtol=1e-7, atol=1e-12)


@pytest.mark.parametrize("heads", [3, 8])
def test_bam_without_location_is_kerple_power_but_for_eps(heads):
    """With mu = 0 and 0 < beta <= 2, BAM is KERPLE's power kernel with r1 = e^s and r2 = beta: equal to
    float64 rounding with eps = 0, within eps's own effect (r1 * r2 * eps * d^(r2 - 1)) with it."""
    torch.manual_seed(heads)
    bam = make("bam", heads).double()
    power = make("kerple_power", heads).double()
    with torch.no_grad():
        bam.shape.copy_(power.r2.clamp(0.01, 2.0))
        bam.scale.copy_(power.r1.clamp(min=0.01).log())
    distances = torch.arange(1, 5000, dtype=torch.float64)
    with_eps = bam(distances)
    bam.eps = 0.0
    torch.testing.assert_close(bam(distances), power(distances), rtol=1e-12, atol=1e-12)
    r1, r2 = power.r1.clamp(min=0.01)[:, None], power.r2.clamp(0.01, 2.0)[:, None]
    bound = 1.01 * r1 * r2 * 1e-5 * torch.maximum(distances ** (r2 - 1), (distances + 1e-5) ** (r2 - 1))
    assert ((with_eps - power(distances)).abs() <= bound).all()
    # a location moves the peak: beta = 2 with mu = -m is greatest at d = m
    with torch.no_grad():
        bam.shape.fill_(2.0)
        bam.loc.fill_(math.asinh(-7.0 / 2))
    assert (bam(torch.arange(0, 20, dtype=torch.float64)).argmax(dim=1) == 7).all()


def test_bam_negative_shapes_favour_distant_keys():
    bam = make("bam", 4, {"bam_shape_init": -0.5})
    bias = bam(torch.arange(0, 4096, dtype=torch.float32))
    assert torch.isfinite(bias).all() and (bias.diff(dim=1) > 0).all()


def test_every_kernel_documents_formula_and_paper_section():
    for name, cls in KERNELS.items():
        doc = cls.__doc__ or ""
        assert "B_h(d)" in doc or "W_h(d)" in doc, name
        assert "§" in doc or "Appendix" in doc or name == "none", name
        if cls.options is not None:
            for f in dataclasses.fields(cls.options):
                assert f.metadata.get("help"), f"{name}: option {f.name} has no help"


def test_every_rotary_scaling_documents_its_paper_and_options():
    """Each scaling's module says its formula's source (a paper or post, with its year); each option has help."""
    import re
    import sys

    from kerple_core.attention.rotary.scalings import ROTARY_SCALING_CLASSES

    assert set(ROTARY_SCALING_CLASSES) == {"ntk", "dynamic-ntk", "yarn", "rerope", "leaky-rerope", "xpos", "p-rope"}
    for name, cls in ROTARY_SCALING_CLASSES.items():
        assert re.search(r"\b20\d\d\b", sys.modules[cls.__module__].__doc__ or ""), name
        for f in dataclasses.fields(cls.options) if cls.options is not None else ():
            assert f.metadata.get("help"), f"{name}: option {f.name} has no help"


def test_readme_lists_every_kernel_method_and_option():
    """A row per kernel, layer bias and visibility rule (by name) and per attention method (each of its command lines, the
    first cell starting with it), every option of each in the README; the rotary family's by hand."""
    from conftest import REPO
    from kerple_core.attention.methods import ATTENTION_METHODS, attention_method_option_fields
    from kerple_core.attention.rotary import ROTARY_SCALINGS, rotary_option_fields
    from kerple_core.kernels import option_fields
    from kerple_core.layer_biases import LAYER_BIASES, layer_bias_option_fields
    from kerple_core.visibility import VISIBILITY_RULES, visibility_rule_option_fields

    readme = (REPO / "README.md").read_text()
    scalings = [f"--rotary-scaling {name}" for name in ROTARY_SCALINGS if name != "none"]
    for name in [*KERNELS, *LAYER_BIASES, *VISIBILITY_RULES, "--rotary-xpos", "--rotary-fraction p", *scalings]:
        assert f"| `{name}` |" in readme, f"README's method table lacks {name}"
    for method in ATTENTION_METHODS.values():
        for flags in method.command_lines().values():
            assert f"| `{' '.join(flags)}`" in readme, f"README's method table lacks {method.name} ({' '.join(flags)})"
    for f in option_fields() + layer_bias_option_fields() + visibility_rule_option_fields() + \
            attention_method_option_fields():
        flag = "--" + f.name.replace("_", "-")
        assert flag in readme, f"README does not mention {flag}"
    for flag in ["--" + f.name.replace("_", "-") for f in rotary_option_fields()] + ["--layer-positions"]:
        assert flag in readme, f"README does not mention {flag}"
