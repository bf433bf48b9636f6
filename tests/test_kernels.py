"""Each kernel's bias against an independent float64 loop, gradients, constraints."""

import dataclasses

import numpy as np
import pytest
import torch

from kerple_fairseq import KernelConfigError
from kerple_fairseq.kernels import KERNELS, build_kernel, kernel_names
from kerple_fairseq.kernels.alibi import alibi_slopes
from kerple_fairseq.models.attention_bias import AttentionBias

import reference

HEADS = [8, 12, 16]
LENGTHS = [1, 5, 64, 300]
LEARNABLE = ["kerple_log", "kerple_power"]


def reference_fn(kernel):
    with torch.no_grad():
        if kernel.name == "alibi":
            return reference.alibi(reference.alibi_slopes_reference(kernel.num_heads))
        if kernel.name == "none":
            return reference.no_bias()
        r1 = kernel.r1.double().tolist()
        r2 = kernel.r2.double().tolist()
    return {"kerple_log": reference.kerple_log, "kerple_power": reference.kerple_power}[kernel.name](r1, r2)


def test_registry_lists_the_issue_kernels():
    assert {"alibi", "kerple_log", "kerple_power", "none"} <= set(kernel_names())


@pytest.mark.parametrize("name", sorted(KERNELS))
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("length", LENGTHS)
def test_bias_matches_float64_reference(name, heads, length):
    torch.manual_seed(heads * 1000 + length)
    kernel = build_kernel(name, heads)
    mask = AttentionBias(kernel).build(length, length, torch.float32, "cpu").detach()
    assert mask.dtype == torch.float32 and mask.shape == (heads, length, length)
    expected = reference.bias_matrix(heads, length, reference_fn(kernel))
    finite = np.isfinite(expected)
    np.testing.assert_array_equal(np.isfinite(mask.numpy()), finite)
    np.testing.assert_allclose(mask.numpy()[finite], expected[finite], rtol=2e-6, atol=1e-5)


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_incremental_rows_are_the_last_rows_of_the_full_bias(name):
    kernel = build_kernel(name, 8)
    bias = AttentionBias(kernel)
    full = bias.build(40, 40, torch.float32, "cpu")
    torch.testing.assert_close(bias.build(1, 40, torch.float32, "cpu"), full[:, -1:, :])
    torch.testing.assert_close(bias.build(7, 40, torch.float32, "cpu"), full[:, -7:, :])


def test_alibi_slopes_for_8_heads_are_halves_to_1_over_256():
    assert alibi_slopes(8) == [1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128, 1 / 256]


@pytest.mark.parametrize("heads", [1, 2, 3, 5, 6, 12, 16, 20, 24])
def test_alibi_slopes_follow_spec_for_any_head_count(heads):
    np.testing.assert_allclose(alibi_slopes(heads), reference.alibi_slopes_reference(heads), rtol=1e-15)


def test_alibi_slopes_for_12_heads():
    # 8 geometric slopes 2^-1..2^-8, then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5
    expected = [2.0 ** -k for k in range(1, 9)] + [2.0 ** -(k + 0.5) for k in range(4)]
    np.testing.assert_allclose(alibi_slopes(12), expected, rtol=1e-15)


@pytest.mark.parametrize("name", LEARNABLE)
def test_gradients_of_learnable_parameters(name):
    torch.manual_seed(0)
    kernel = build_kernel(name, 4).double()
    distances = torch.arange(0, 50, dtype=torch.float64)
    inputs = tuple(p.detach().clone().requires_grad_(True) for p in kernel.parameters())
    assert inputs, "a learnable kernel has parameters"
    assert torch.autograd.gradcheck(lambda *v: _functional(kernel, distances, v), inputs)


def _functional(kernel, distances, values):
    """The kernel's bias as a function of its raw parameters (for gradcheck)."""
    names = [n for n, _ in kernel.named_parameters()]
    return torch.func.functional_call(kernel, dict(zip(names, values)), (distances,))


@pytest.mark.parametrize("name", LEARNABLE)
def test_parameters_are_per_head_and_bias_has_no_nan_gradient_at_zero_distance(name):
    kernel = build_kernel(name, 12)
    for p in kernel.parameters():
        assert p.shape == (12,)
    out = kernel(torch.arange(0, 10, dtype=torch.float32))
    out.sum().backward()
    for p in kernel.parameters():
        assert torch.isfinite(p.grad).all()


@pytest.mark.parametrize("name", LEARNABLE)
def test_constraints_hold_after_optimiser_steps_pushing_out_of_domain(name):
    torch.manual_seed(1)
    kernel = build_kernel(name, 8)
    opt = torch.optim.SGD(kernel.parameters(), lr=1e3)
    distances = torch.arange(0, 100, dtype=torch.float32)
    for step in range(5):
        opt.zero_grad()
        # push r1 and r2 towards -inf and +inf alternately
        sign = 1.0 if step % 2 == 0 else -1.0
        (sign * kernel(distances).sum()).backward()
        opt.step()
        r1, r2 = kernel.r1, kernel.r2
        assert (r1 >= kernel.floor).all() and (r2 >= kernel.floor).all()
        if name == "kerple_power":
            assert (r2 <= 2.0).all()
        assert torch.isfinite(kernel(distances)).all()
        assert all(torch.isfinite(p.grad).all() for p in kernel.parameters())
    # the hostile steps did drive the parameters towards their bounds
    assert kernel.r1.min() < 0.05


def test_reference_initialisation_ranges():
    torch.manual_seed(0)
    log = build_kernel("kerple_log", 4096)
    assert log.r1.max() < 2.0 and log.r2.max() < 1.0
    assert 0.9 < log.r1.mean() < 1.1 and 0.4 < log.r2.mean() < 0.6
    power = build_kernel("kerple_power", 4096)
    assert power.r1.max() < 1.0
    assert 0.4 < power.r1.mean() < 0.6 and 0.9 < power.r2.mean() < 1.1


def test_reparameterisation_round_trips_inside_the_domain():
    from kerple_fairseq.kernels.constraints import bounded, bounded_inverse, positive, positive_inverse

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


@pytest.mark.parametrize("floor", [0.0, -1.0, 1.0])
def test_out_of_range_option_is_a_clear_error(floor):
    with pytest.raises(KernelConfigError, match="--kernel-param-floor must be in"):
        build_kernel("kerple_log", 8, argparse_namespace(kernel_param_floor=floor))


def argparse_namespace(**kwargs):
    import argparse

    return argparse.Namespace(**kwargs)


def test_every_kernel_documents_formula_and_paper_section():
    for name, cls in KERNELS.items():
        doc = cls.__doc__ or ""
        assert "B_h(d)" in doc and "§" in doc or name == "none" and "B_h(d) = 0" in doc, name
        if cls.options is not None:
            for f in dataclasses.fields(cls.options):
                assert f.metadata.get("help"), f"{name}: option {f.name} has no help"
