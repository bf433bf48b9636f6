"""Per-token scores and the paired bootstrap of ``kerple-analyze compare``: the bootstrap against a direct
computation and its coverage on synthetic losses of known difference, a model against itself, and
files that scored different tokens."""

import json
import math

import numpy as np
import pytest

from kerple_fairseq.analysis.significance import compare
from kerple_fairseq.errors import UsageError
from kerple_fairseq.evaluation import per_token
from kerple_fairseq.evaluation import spans as S
from kerple_fairseq.evaluation.per_token import TokenScores

from conftest import BIN, run


def synthetic(rng, num_units, tokens_per_unit, mean_loss, shift, unit_sd=0.4, token_sd=1.0):
    """Two models' per-token scores over the same blocks: a per-unit difficulty shared by both
    (the pairing), independent token noise, and model B's expected loss ``shift`` above A's."""
    spans = S.early_token_cursed(num_units * tokens_per_unit, tokens_per_unit)
    difficulty = np.repeat(rng.normal(0, unit_sd, num_units), tokens_per_unit)
    scored = []
    for offset in (0.0, shift):
        loss = mean_loss + offset + difficulty + rng.normal(0, token_sd, difficulty.size)
        scores = np.split(-loss, num_units)
        scored.append(TokenScores.from_spans(spans, scores))
    return scored


def direct_standard_error(a: TokenScores, b: TokenScores) -> float:
    """The delta-method standard error of ppl_B - ppl_A from the units' paired losses."""
    units = a.span.max() + 1
    counts = np.bincount(a.span, minlength=units)
    sums = [np.bincount(s.span, weights=-s.log_prob.astype(np.float64), minlength=units) for s in (a, b)]
    n = counts.sum()
    means = [s.sum() / n for s in sums]
    ppl = [math.exp(m) for m in means]
    influence = (ppl[1] * (sums[1] - means[1] * counts) - ppl[0] * (sums[0] - means[0] * counts)) / n
    return math.sqrt(units * influence.var(ddof=1))


def test_spans_to_token_arrays_by_brute_force():
    spans = S.early_token_cursed(10, 4) + S.last_token(np.array([5, 9]), 3)
    scores = [np.arange(w.end - w.score_from, dtype=np.float32) - 10 * k for k, w in enumerate(spans)]
    t = TokenScores.from_spans(spans, scores)
    expected = [(p, k, p - w.start, float(scores[k][p - w.score_from]))
                for k, w in enumerate(spans) for p in range(w.score_from, w.end)]
    assert list(zip(t.target.tolist(), t.span.tolist(), t.position.tolist(), t.log_prob.tolist())) == expected


def test_bootstrap_spread_matches_the_direct_standard_error():
    rng = np.random.default_rng(0)
    a, b = synthetic(rng, num_units=400, tokens_per_unit=16, mean_loss=2.0, shift=0.03)
    c = compare("early-token-cursed", 16, ["a", "b"], [a, b], samples=4000, seed=3)
    low, high = c.difference_interval[0]
    bootstrap_se = (high - low) / (2 * 1.96)
    assert abs(bootstrap_se / direct_standard_error(a, b) - 1) < 0.1
    assert c.perplexities[0] == pytest.approx(math.exp(-a.log_prob.astype(np.float64).mean()), rel=1e-12)


def test_the_95_percent_interval_covers_the_true_difference_about_95_percent_of_the_time():
    rng = np.random.default_rng(1)
    mean_loss, shift, token_sd, unit_sd = 2.0, 0.05, 1.0, 0.4
    # the population perplexities: exp of the expected loss per token
    truth = math.exp(mean_loss + shift) - math.exp(mean_loss)
    covered = []
    for repeat in range(300):
        a, b = synthetic(rng, 150, 8, mean_loss, shift, unit_sd, token_sd)
        low, high = compare("early-token-cursed", 8, ["a", "b"], [a, b], samples=600, seed=repeat).difference_interval[0]
        covered.append(low <= truth <= high)
    assert 0.91 <= np.mean(covered) <= 0.98, np.mean(covered)


def test_a_model_against_itself_differs_by_exactly_zero():
    rng = np.random.default_rng(2)
    a, _ = synthetic(rng, 50, 8, 2.0, 0.0)
    c = compare("early-token-cursed", 8, ["a", "a again"], [a, a], samples=200)
    assert c.difference == [0.0] and c.difference_interval == [[0.0, 0.0]]
    assert c.ratio == [1.0] and c.ratio_interval == [[1.0, 1.0]] and c.ordering_flips == [0.0]


def test_a_clear_difference_never_flips_and_a_null_one_often_does():
    rng = np.random.default_rng(4)
    a, b = synthetic(rng, 300, 16, 2.0, 0.3)
    clear = compare("early-token-cursed", 16, ["a", "b"], [a, b], samples=500)
    assert clear.difference_interval[0][0] > 0 and clear.ordering_flips == [0.0]
    a, b = synthetic(rng, 300, 16, 2.0, 0.0)
    null = compare("early-token-cursed", 16, ["a", "b"], [a, b], samples=500)
    assert null.difference_interval[0][0] < 0 < null.difference_interval[0][1]
    assert 0.02 < null.ordering_flips[0] < 0.98


def test_files_that_scored_different_tokens_are_refused():
    rng = np.random.default_rng(5)
    a, _ = synthetic(rng, 20, 8, 2.0, 0.0)
    b, _ = synthetic(rng, 21, 8, 2.0, 0.0)
    with pytest.raises(UsageError, match="b and a scored different tokens under early-token-cursed at length 8"):
        compare("early-token-cursed", 8, ["a", "b"], [a, b])


def write(path, split, fingerprint, scored):
    per_token.save(str(path), split, fingerprint, {("early-token-cursed", 8): scored})
    return path


@pytest.mark.slow
def test_compare_command_reads_per_token_files_and_refuses_other_splits(tmp_path):
    rng = np.random.default_rng(6)
    a, b = synthetic(rng, 40, 8, 2.0, 0.1)
    fa = write(tmp_path / "a.scores", "valid", "f1", a)  # any name: numpy adds no suffix
    fb = write(tmp_path / "b.scores", "valid", "f1", b)
    loaded = per_token.load(str(fa))
    assert loaded.split == "valid" and np.array_equal(loaded.scored[("early-token-cursed", 8)].log_prob, a.log_prob)
    analyze = [BIN / "kerple-analyze", "compare"]
    proc = run([*analyze, "--path", fa, fb, "--labels", "A", "B", "--out", tmp_path / "out", "--samples", "300"])
    assert "early-token-cursed L=8: 320 tokens in 40 units" in proc.stdout
    result = json.loads((tmp_path / "out" / "compare.json").read_text())
    assert result[0]["labels"] == ["A", "B"] and len(result[0]["difference_interval"]) == 1
    other = write(tmp_path / "c.scores", "test", "f2", b)
    for bad, message in (([fa, other], "C scored split 'test'"), ([fa, tmp_path / "none.npz"], "no such file"),
                         ([fa, tmp_path / "out" / "compare.json"], "is not a kerple-eval-lm --per-token file")):
        proc = run([*analyze, "--path", *bad, "--labels", "A", "C", "--out", tmp_path / "out"], check=False)
        last = proc.stderr.strip().splitlines()[-1]
        assert proc.returncode != 0 and last.startswith("kerple-analyze: error:") and message in last
        assert "Traceback" not in proc.stderr
