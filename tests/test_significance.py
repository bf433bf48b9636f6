"""Per-token scores and the paired bootstrap of ``kerple-analyze compare``: the bootstrap against a direct
computation and its coverage on synthetic losses of known difference, a model against itself, and
files that scored different tokens; the spread over training runs (seeds) against a direct computation."""

import json
import math
import statistics

import numpy as np
import pytest

from kerple_fairseq.analysis.significance import across_seeds, compare, compare_spans
from kerple_fairseq.errors import UsageError
from kerple_fairseq.evaluation import per_token, span_losses
from kerple_fairseq.evaluation import spans as S
from kerple_fairseq.evaluation.per_token import TokenScores

from conftest import BIN, REPO, run
from console_scripts import run_forked


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


def test_span_losses_are_each_spans_summed_loss_and_compare_alike(tmp_path):
    rng = np.random.default_rng(7)
    a, b = synthetic(rng, 30, 8, 2.0, 0.1)
    b_last = TokenScores.from_spans(S.last_token(np.array([3, 40, 41]), 5), [np.array([-1.5], np.float32)] * 3)
    kept = {("early-token-cursed", 8): span_losses.SpanLosses.of(a), ("last-token", 5): span_losses.SpanLosses.of(b_last)}
    for k in range(30):  # by brute force
        tokens = a.span == k
        assert kept["early-token-cursed", 8].loss[k] == pytest.approx(-sum(float(x) for x in a.log_prob[tokens]), rel=1e-12)
        assert kept["early-token-cursed", 8].count[k] == 8
    path = tmp_path / "kept"  # any name: numpy adds no suffix
    span_losses.save(str(path), kept)
    loaded = span_losses.load(str(path))
    assert list(loaded) == list(kept) and not list(tmp_path.glob("*.partial"))
    for key, s in kept.items():
        assert np.array_equal(loaded[key].loss, s.loss) and np.array_equal(loaded[key].count, s.count)
        assert loaded[key].tokens == s.tokens
    # the bootstrap on span losses is the bootstrap on the tokens
    spans = [span_losses.SpanLosses.of(t) for t in (a, b)]
    assert compare_spans("early-token-cursed", 8, ["a", "b"], spans, samples=300).as_dict() == compare(
        "early-token-cursed", 8, ["a", "b"], [a, b], samples=300).as_dict()
    # other tokens are never paired, even with as many spans of as many tokens
    shifted = TokenScores(a.target + 1, a.span, a.position, a.log_prob)
    with pytest.raises(UsageError, match="b and a scored different tokens"):
        compare_spans("early-token-cursed", 8, ["a", "b"], [spans[0], span_losses.SpanLosses.of(shifted)])
    for bad, message in ((tmp_path / "none.npz", "no such file"), (tmp_path / "bad.npz", "is not a file of span losses")):
        if message != "no such file":
            per_token.save(str(bad), "valid", "f", {("last-token", 5): b_last})
        with pytest.raises(UsageError, match=message):
            span_losses.load(str(bad))


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
    proc = run_forked("kerple-analyze", ["compare", "--path", fa, fb, "--labels", "A", "B", "--out", tmp_path / "out",
                                         "--samples", "300"], REPO)
    assert "early-token-cursed L=8: 320 tokens in 40 units" in proc.stdout
    result = json.loads((tmp_path / "out" / "compare.json").read_text())
    [comparison] = result["comparisons"]
    assert comparison["labels"] == ["A", "B"] and len(comparison["difference_interval"]) == 1
    assert result["across_seeds"] == []
    other = write(tmp_path / "c.scores", "test", "f2", b)
    for bad, message in (([fa, other], "C scored split 'test'"), ([fa, tmp_path / "none.npz"], "no such file"),
                         ([fa, tmp_path / "out" / "compare.json"], "is not a kerple-eval-lm --per-token file")):
        proc = run_forked("kerple-analyze", ["compare", "--path", *bad, "--labels", "A", "C", "--out", tmp_path / "out"],
                          REPO, check=False)
        last = proc.stderr.strip().splitlines()[-1]
        assert proc.returncode != 0 and last.startswith("kerple-analyze: error:") and message in last
        assert "Traceback" not in proc.stderr


def test_spread_over_seeds_matches_a_direct_computation():
    """Mean and sample standard deviation over runs of each model's perplexity and of its difference to
    the first model run by run, computed here with the statistics module from each run's own perplexities."""
    rng = np.random.default_rng(7)
    runs, a_ppl, b_ppl = [], [], []
    for k in range(3):
        a, b = synthetic(rng, 30, 8, 2.0 + 0.05 * k, 0.1 - 0.08 * k)
        runs.append(compare("last-token", 8, ["a", "b"], [a, b], samples=50, replicate=k + 1))
        a_ppl.append(math.exp(-math.fsum(a.log_prob.tolist()) / a.log_prob.size))
        b_ppl.append(math.exp(-math.fsum(b.log_prob.tolist()) / b.log_prob.size))
    spread = across_seeds(runs)
    differences = [b - a for a, b in zip(a_ppl, b_ppl)]
    assert spread.runs == 3 and spread.labels == ["a", "b"]
    assert spread.mean == pytest.approx([statistics.mean(a_ppl), statistics.mean(b_ppl)], rel=1e-12)
    assert spread.sd == pytest.approx([statistics.stdev(a_ppl), statistics.stdev(b_ppl)], rel=1e-12)
    assert spread.difference_mean == pytest.approx([statistics.mean(differences)], rel=1e-12)
    assert spread.difference_sd == pytest.approx([statistics.stdev(differences)], rel=1e-12)
    assert spread.difference_range == [[min(differences), max(differences)]]
    mean_sign = math.copysign(1, statistics.mean(differences))
    assert spread.same_sign == [sum(math.copysign(1, d) == mean_sign for d in differences)]
    assert 0 < spread.same_sign[0] < 3, "the synthetic runs disagree on the ordering"
    with pytest.raises(UsageError, match="at least two runs"):
        across_seeds(runs[:1])
    with pytest.raises(UsageError, match="same models"):
        across_seeds([runs[0], compare("last-token", 8, ["a", "c"], [a, b], samples=10)])


@pytest.mark.slow
def test_compare_command_groups_runs_of_a_model_by_label(tmp_path):
    """Files sharing a label are runs (seeds) of one model: each run is compared with the same run of
    the baseline, exactly as a separate call would, and the spread over runs is reported."""
    rng = np.random.default_rng(8)
    files = {}
    for k in (1, 2):
        a, b = synthetic(rng, 30, 8, 2.0, 0.05 * k)
        files[("A", k)] = write(tmp_path / f"a{k}.npz", "valid", "f1", a)
        files[("B", k)] = write(tmp_path / f"b{k}.npz", "valid", "f1", b)
    analyze = ["compare", "--samples", "200"]
    # the grouped call a process of its own, the separate ones forked: nothing rests on what forked runs share
    run([BIN / "kerple-analyze", *analyze, "--path", files["A", 1], files["A", 2], files["B", 1], files["B", 2],
         "--labels", "A", "A", "B", "B", "--out", tmp_path / "both"])
    both = json.loads((tmp_path / "both" / "compare.json").read_text())
    for k in (1, 2):
        run_forked("kerple-analyze", [*analyze, "--path", files["A", k], files["B", k], "--labels", "A", "B", "--out",
                                      tmp_path / f"run{k}"], REPO)
        [alone] = json.loads((tmp_path / f"run{k}" / "compare.json").read_text())["comparisons"]
        alone["replicate"] = k
        assert both["comparisons"][k - 1] == alone
    [spread] = both["across_seeds"]
    differences = [both["comparisons"][k]["difference"][0] for k in (0, 1)]
    assert spread["runs"] == 2 and spread["difference_mean"] == pytest.approx([statistics.mean(differences)])
    proc = run_forked("kerple-analyze", [*analyze, "--path", files["A", 1], files["A", 2], files["B", 1], "--labels",
                                         "A", "A", "B", "--out", tmp_path / "uneven"], REPO, check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == ("kerple-analyze: error: a label repeated names the runs (seeds) "
                                                    "of one model, and every model needs as many: A has 2, B has 1")
    assert not (tmp_path / "uneven").exists()


def test_resampled_weights_are_the_draws_counted():
    """The bootstrap by weights equals drawing the units one by one (the same stream), perplexity by perplexity."""
    from kerple_fairseq.analysis.significance import bootstrap_perplexities, resample_weights
    rng = np.random.default_rng(0)
    losses, counts = rng.uniform(1, 9, size=(3, 37)), rng.integers(5, 60, size=37)
    weights = np.concatenate(list(resample_weights(37, 250, seed=4)))
    direct = np.random.default_rng(4).integers(0, 37, size=(250, 37))  # one chunk: 250 x 37 draws
    assert np.array_equal(weights, np.stack([np.bincount(row, minlength=37) for row in direct]))
    expected = np.exp(np.stack([losses[:, row].sum(axis=1) / counts[row].sum() for row in direct]))
    np.testing.assert_allclose(bootstrap_perplexities(losses, counts, 250, seed=4), expected, rtol=1e-12)


@pytest.mark.parametrize("probability, df, expected", [
    (0.975, 1, 12.706205), (0.975, 2, 4.302653), (0.975, 26, 2.055529), (0.975, 199, 1.971957), (0.995, 10, 3.169273)])
def test_student_t_quantiles_match_the_tables(probability, df, expected):
    from kerple_fairseq.analysis.significance import student_t_quantile
    assert student_t_quantile(probability, df) == pytest.approx(expected, abs=2e-6)


def test_the_t_interval_is_the_jackknife_error_by_leaving_each_unit_out():
    from kerple_fairseq.analysis.significance import jackknife_t_interval, student_t_quantile
    rng = np.random.default_rng(2)
    counts = rng.integers(100, 300, size=27)
    losses = np.stack([counts * rng.normal(5.0, 0.3, 27), counts * rng.normal(5.05, 0.3, 27)])
    left_out = []
    for i in range(27):  # the difference of perplexities without unit i, by plain loops
        keep = [j for j in range(27) if j != i]
        ppl = [math.exp(sum(losses[m, j] for j in keep) / sum(counts[j] for j in keep)) for m in (0, 1)]
        left_out.append(ppl[1] - ppl[0])
    mean = sum(left_out) / 27
    error = math.sqrt(26 / 27 * sum((x - mean) ** 2 for x in left_out))
    difference = math.exp(losses[1].sum() / counts.sum()) - math.exp(losses[0].sum() / counts.sum())
    half = student_t_quantile(0.975, 26) * error
    assert jackknife_t_interval(losses, counts, 0.95) == pytest.approx([difference - half, difference + half], rel=1e-9)
    assert all(math.isnan(x) for x in jackknife_t_interval(losses[:, :1], counts[:1], 0.95))


def test_the_inner_bootstrap_interval_is_its_endpoints_moved_by_their_monte_carlo_error():
    """A percentile endpoint of B resamples moves inward by 3.29 binomial standard errors of its rank; the deciding
    interval is the more conservative of that and the t-interval at each end."""
    from kerple_fairseq.analysis.leaderboard import RESOLVED, NOT_RESOLVED, Versus
    from kerple_fairseq.analysis.significance import bootstrap_perplexities, paired_differences
    rng = np.random.default_rng(5)
    counts = rng.integers(50, 80, size=200)
    losses = np.stack([counts * rng.normal(5.0, 0.4, 200), counts * rng.normal(5.02, 0.4, 200)])
    (found,) = paired_differences(losses, counts, [(0, 1)], samples=4000, seed=9, confidence=0.95)
    boot = bootstrap_perplexities(losses, counts, 4000, seed=9)
    difference = boot[:, 1] - boot[:, 0]
    step = 3.29 * math.sqrt(0.025 * 0.975 / 4000)
    assert found.bootstrap == pytest.approx(np.percentile(difference, [2.5, 97.5]).tolist())
    assert found.bootstrap_inner == pytest.approx(np.percentile(difference, [100 * (0.025 + step),
                                                                             100 * (0.975 - step)]).tolist())
    assert found.bootstrap[0] < found.bootstrap_inner[0] < found.bootstrap_inner[1] < found.bootstrap[1]
    v = Versus("b", "a", "last-token", 64, [1], [1.0], [[0.5, 1.5]], [[0.6, 1.4]], [[0.7, 1.6]], 200)
    assert v.interval == [[0.6, 1.6]] and v.verdict == RESOLVED
    v.t_interval = [[-0.1, 1.6]]
    assert v.interval == [[-0.1, 1.6]] and v.verdict == NOT_RESOLVED, "the t-interval decides where it is wider"
    v.t_interval, v.bootstrap_inner = [[0.7, 1.6]], [[-0.01, 1.4]]
    assert v.verdict == NOT_RESOLVED, "the bootstrap decides where it is wider beyond its Monte-Carlo error"
