"""The float64 references of the attention rules after FoX against facts that do not depend on them."""

import math

import torch

from attention_rule_reference import (causal_softmax, llama4_query_temperature, swan_query_scale, log_space_stick_breaking,
                                      rerope_logits, selective_logits, ssmax_logits, stick_breaking)


def randn(*shape, seed=0):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def test_stick_breaking_weights_and_remainder_make_one_stick():
    z, v = randn(7, 7) * 2, randn(7, 3, seed=1)
    for attend_current in (False, True):
        weights, rest = stick_breaking(z, attend_current=attend_current)
        torch.testing.assert_close(weights.sum(1) + rest, torch.ones(7, dtype=torch.float64), rtol=0, atol=1e-14)
        torch.testing.assert_close(weights, log_space_stick_breaking(z, attend_current), rtol=1e-12, atol=1e-15)
        assert torch.all(torch.triu(weights, 0 if not attend_current else 1) == 0)
    _, _, out = stick_breaking(z, v)
    torch.testing.assert_close(out[0], v[0])  # the first query has no key: its whole stick is its own value
    z[5, 3] = 50.0  # a key with sigmoid 1 takes the whole stick: nothing before it is seen
    weights, _ = stick_breaking(z)
    assert weights[5, :3].max() < 1e-20


def test_ssmax_with_unit_scale_at_one_key_and_llama4_temperature():
    z = randn(5, 5)
    scaled = ssmax_logits(z, s=1.0)
    assert scaled[0, 0] == 0.0  # log 1
    torch.testing.assert_close(scaled[4, :5], z[4, :5] * math.log(5))
    torch.testing.assert_close(ssmax_logits(z, 0.5, first_position=10)[0, 0], z[0, 0] * 0.5 * math.log(11))
    assert llama4_query_temperature(8190) == 1.0 and llama4_query_temperature(8191) == 1.0 + 0.1 * math.log(2)
    assert swan_query_scale(0) == 1.0 and math.isclose(swan_query_scale(362), 1.0 + math.log(2) / math.log(362),
                                                       rel_tol=1e-15)


def test_selective_attention_without_positive_head_0_logits_changes_nothing():
    z = randn(3, 6, 6, seed=2)
    z[0] = -z[0].abs()
    causal = torch.tril(torch.ones(6, 6, dtype=torch.bool))
    assert torch.equal(selective_logits(z)[:, causal], z[:, causal])
    z[0, 2, 1] = 3.0  # query 2 hides key 1 from every later query, by 3
    out = selective_logits(z)
    assert out[1, 2, 1] == z[1, 2, 1] and out[1, 3, 1] == z[1, 3, 1] - 3.0 and out[2, 5, 1] == z[2, 5, 1] - 3.0


def test_rerope_within_its_window_is_rotary_and_beyond_it_sees_distance_window():
    q, k = randn(9, 8, seed=3), randn(9, 8, seed=4)
    plain = rerope_logits(q, k, window=100)
    clamped = rerope_logits(q, k, window=4)
    causal = torch.tril(torch.ones(9, 9, dtype=torch.bool))
    near = causal & ((torch.arange(9)[:, None] - torch.arange(9)[None, :]) < 4)
    assert torch.equal(clamped[near], plain[near])
    # beyond the window every key is at distance 4: the same as a key 4 back with the same vectors
    k2 = k.clone()
    k2[4] = k[0]
    torch.testing.assert_close(clamped[8, 0], rerope_logits(q, k2, window=100)[8, 4])
    # leaky, k = 2: distance 8 is seen as 4 + (8 - 4) / 2 = 6
    k6 = k.clone()
    k6[2] = k[0]
    torch.testing.assert_close(rerope_logits(q, k, window=4, leak=2.0)[8, 0], rerope_logits(q, k6, window=100)[8, 2])
    probabilities = causal_softmax(clamped)
    assert torch.isfinite(probabilities).all()
    torch.testing.assert_close(probabilities.sum(1), torch.ones(9, dtype=torch.float64))
