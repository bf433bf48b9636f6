"""The precision table of the biased logits (scripts/logit_precision.py): each backend's rounding as
documented, checked on values whose rounding is known."""

import torch

from kerple_fairseq.experiments.logit_precision import largest_errors, logits, table


def test_where_each_backend_rounds():
    scores, weight, bias = torch.tensor([1 / 3]), torch.tensor([1.0]), torch.tensor([-62.1])
    exact = (scores.double() + bias.double()).item()
    # bf16 keeps 8 significant bits: 1/3 -> 0.333984375, -62.1 -> -62.0 (spacing 0.25 in [32, 64))
    assert logits("explicit", scores, weight, bias, torch.bfloat16).item() == (0.333984375 + bias).item()
    assert logits("sdpa", scores, weight, bias, torch.bfloat16).item() == (scores - 62.0).item()
    assert abs(logits("flex", scores, weight, bias, torch.bfloat16).item() - exact) < 1e-5
    assert abs(logits("sdpa", scores, weight, bias, torch.bfloat16).item() - exact) <= 0.125


def test_largest_errors_by_backend():
    errors = largest_errors("alibi", [256, 4096], heads=8)
    for precision in ("fp16", "bf16"):
        # the bias is exact in float32 and ALiBi's values below 256 are exact in half precision too
        assert errors["flex", precision, 256] < 1e-5
        assert errors["sdpa", precision, 256] < 1e-5
        # at 4096 the steepest head reaches -2047.5, rounded in fp16 (spacing 2) and bf16 (spacing 8)
        assert errors["sdpa", precision, 4096] >= 0.5
        assert errors["flex", precision, 4096] < 1e-3
        # the explicit path rounds the score alone (scores of N(0, 3^2): below 20 in magnitude), not the bias
        unit = {"fp16": 2 ** -11, "bf16": 2 ** -8}[precision]
        assert 0 < errors["explicit", precision, 4096] <= 20 * unit
    assert "sdpa" not in {backend for backend, *_ in largest_errors("kerple_bias_wht", [64])}, "a weight kernel"


def test_table_has_a_row_per_kernel_and_backend():
    rows = table(["alibi", "kerple_bias_wht"], [64, 128]).splitlines()
    assert rows[0] == "| kernel | backend | fp16 64 | fp16 128 | bf16 64 | bf16 128 |"
    assert [r.split(" | ")[:2] for r in rows[2:]] == [["| alibi", "explicit"], ["| alibi", "sdpa"], ["| alibi", "flex"],
                                                     ["| kerple_bias_wht", "explicit"], ["| kerple_bias_wht", "flex"]]
