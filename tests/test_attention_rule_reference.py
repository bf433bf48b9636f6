"""The float64 references of the attention rules after FoX against facts that do not depend on them."""

import math

import numpy as np

from attention_rule_reference import (causal_softmax, llama4_query_temperature, log_space_stick_breaking,
                                      rerope_logits, selective_logits, ssmax_logits, stick_breaking)


def test_stick_breaking_weights_and_remainder_make_one_stick():
    rng = np.random.default_rng(0)
    z, v = rng.normal(size=(7, 7)) * 2, rng.normal(size=(7, 3))
    for attend_current in (False, True):
        weights, rest, out = stick_breaking(z, v, attend_current=attend_current)
        np.testing.assert_allclose(weights.sum(1) + rest, 1.0, rtol=0, atol=1e-14)
        np.testing.assert_allclose(weights, log_space_stick_breaking(z, attend_current), rtol=1e-12, atol=1e-15)
        assert np.all(np.triu(weights, 0 if not attend_current else 1) == 0)
    weights, rest, out = stick_breaking(z, v)
    np.testing.assert_allclose(out[0], v[0])  # the first query has no key: its whole stick is its own value
    # a key with sigmoid 1 takes the whole stick: nothing before it is seen
    z[5, 3] = 50.0
    weights, _, _ = stick_breaking(z, v)
    assert weights[5, :3].max() < 1e-20


def test_ssmax_with_unit_scale_at_one_key_and_llama4_temperature():
    rng = np.random.default_rng(1)
    z = rng.normal(size=(5, 5))
    scaled = ssmax_logits(z, s=1.0)
    assert scaled[0, 0] == 0.0  # log 1
    np.testing.assert_allclose(scaled[4, :5], z[4, :5] * math.log(5))
    np.testing.assert_allclose(ssmax_logits(z, 0.5, first_position=10)[0, 0], z[0, 0] * 0.5 * math.log(11))
    assert llama4_query_temperature(8190) == 1.0 and llama4_query_temperature(8191) == 1.0 + 0.1 * math.log(2)


def test_selective_attention_without_positive_head_0_logits_changes_nothing():
    rng = np.random.default_rng(2)
    z = rng.normal(size=(3, 6, 6))
    z[0] = -np.abs(z[0])
    causal = np.tril(np.ones((6, 6), bool))
    np.testing.assert_array_equal(selective_logits(z)[:, causal], z[:, causal])
    z[0, 2, 1] = 3.0  # query 2 masks key 1 for every later query, by 3
    out = selective_logits(z)
    assert out[1, 2, 1] == z[1, 2, 1] and out[1, 3, 1] == z[1, 3, 1] - 3.0 and out[2, 5, 1] == z[2, 5, 1] - 3.0


def test_rerope_within_its_window_is_rotary_and_beyond_it_sees_distance_window():
    rng = np.random.default_rng(3)
    q, k = rng.normal(size=(9, 8)), rng.normal(size=(9, 8))
    plain = rerope_logits(q, k, window=100)
    clamped = rerope_logits(q, k, window=4)
    causal = np.tril(np.ones((9, 9), bool))
    near = causal & (np.arange(9)[:, None] - np.arange(9)[None, :] < 4)
    np.testing.assert_array_equal(clamped[near], plain[near])
    # beyond the window every key is at distance 4: the same as a key 4 back with the same vectors
    k2 = k.copy()
    k2[4] = k[0]
    np.testing.assert_allclose(clamped[8, 0], rerope_logits(q, k2, window=100)[8, 4])
    # leaky, k = 2: distance 8 is seen as 4 + (8 - 4) / 2 = 6
    k6 = k.copy()
    k6[2] = k[0]
    np.testing.assert_allclose(rerope_logits(q, k, window=4, leak=2.0)[8, 0], rerope_logits(q, k6, window=100)[8, 2])
    assert np.all(np.isfinite(causal_softmax(np.where(causal, clamped, -np.inf))[causal]))
