"""Two training lengths seen together, against a direct computation on synthetic scores (ranks among the
shared models, swapped pairs, each swap's paired comparison at both lengths and its finding), and the
cost estimate and seed plan of a comparison under a budget of hours."""

import json
import math

import numpy as np
import pytest

from kerple_fairseq.analysis import leaderboard, two_lengths
from kerple_fairseq.analysis.leaderboard import NOT_RESOLVED, RESOLVED, Entrant
from kerple_fairseq.analysis.significance import compare
from kerple_fairseq.evaluation import spans as S
from kerple_fairseq.evaluation.per_token import TokenScores
from kerple_fairseq.evaluation.span_losses import SpanLosses
from kerple_fairseq.experiments import run_cost
from kerple_fairseq.experiments.position_encodings import POSITION_ENCODINGS

PROTOCOL = "early-token-cursed"
SEEDS = (1, 2, 3)
# by training length: each model's extra loss at 32x; ALiBi and FIRE swap by far (resolved at both), NoPE and
# rotary by a hair (resolved at neither); T5 is only at the shorter length
GAPS = {8: {"alibi": 0.0, "fire": 0.3, "nope": 0.6, "rotary": 0.601, "t5": 0.9},
        16: {"alibi": 0.3, "fire": 0.0, "nope": 0.601, "rotary": 0.6}}


def board(train_length, seeds_of, rng):
    lengths = (train_length, 32 * train_length)
    spans = {n: S.early_token_cursed(8192, n) for n in lengths}
    difficulty = {n: rng.normal(0, 0.3, len(s)) for n, s in spans.items()}
    scores = {}
    for name, gap in GAPS[train_length].items():
        for seed in seeds_of.get(name, SEEDS):
            scores[name, seed] = {}
            for n, s in spans.items():
                mean = 3.0 + (gap if n > train_length else 0.0)
                scores[name, seed][PROTOCOL, n] = TokenScores.from_spans(
                    s, [-(mean + difficulty[n][i] + rng.normal(0, 0.3, w.end - w.score_from)) for i, w in enumerate(s)])
    ppl = {key: {k: math.exp(-float(np.mean(t.log_prob.astype(np.float64)))) for k, t in s.items()}
           for key, s in scores.items()}
    entrants = [Entrant(name, POSITION_ENCODINGS[name].label, POSITION_ENCODINGS[name].family, ["alibi"],
                        {seed: [{"protocol": PROTOCOL, "length": n, "ppl": ppl[name, seed][PROTOCOL, n]} for n in lengths]
                         for seed in seeds_of.get(name, SEEDS)})
                for name in GAPS[train_length]]
    losses = {key: {k: SpanLosses.of(t) for k, t in s.items()} for key, s in scores.items()}
    return (leaderboard.build(entrants, train_length, lambda name, seed: losses[name, seed], samples=300),
            lambda name, seed: losses[name, seed], scores)


@pytest.fixture(scope="module")
def view():
    rng = np.random.default_rng(0)
    long_, long_scores, long_tokens = board(16, {"nope": (1,)}, rng)
    short, short_scores, short_tokens = board(8, {}, rng)
    # given in either order, the shorter training length comes first
    return two_lengths.build(long_, short, long_scores, short_scores, samples=300), short_tokens, long_tokens


def test_ranks_are_among_the_models_both_lengths_hold(view):
    view, _, _ = view
    assert [b.train_length for b in view.boards] == [8, 16] and set(view.models) == {"alibi", "fire", "nope", "rotary"}
    for k, board in enumerate(view.boards):
        means = {m: board.mean(m, PROTOCOL, board.longest) for m in view.models}
        order = sorted(means, key=means.get)
        assert view.ranks(k, PROTOCOL) == {m: order.index(m) + 1 for m in view.models}
    assert view.ranks(0, PROTOCOL)["alibi"] == 1 and view.ranks(1, PROTOCOL)["fire"] == 1


def test_each_swap_is_compared_at_both_lengths_over_the_seeds_both_models_have(view):
    view, short_tokens, long_tokens = view
    ranks = [view.ranks(k, PROTOCOL) for k in (0, 1)]
    swapped = {(a, b) for a in view.models for b in view.models
               if ranks[0][a] < ranks[0][b] and ranks[1][a] > ranks[1][b]}
    assert {(s.ahead, s.behind) for s in view.swaps} == swapped and ("alibi", "fire") in swapped
    for s in view.swaps:
        for board, tokens, v in zip(view.boards, (short_tokens, long_tokens), s.versus):
            seeds = sorted(set(board.seeds_of(s.ahead)) & set(board.seeds_of(s.behind)))
            assert (v.model, v.reference, v.length, v.seeds) == (s.behind, s.ahead, board.longest, seeds)
            for seed, difference, interval in zip(seeds, v.difference, v.bootstrap_interval):
                direct = compare(PROTOCOL, board.longest, [s.ahead, s.behind],
                                 [tokens[s.ahead, seed][PROTOCOL, board.longest],
                                  tokens[s.behind, seed][PROTOCOL, board.longest]], samples=300, seed=1)
                assert difference == pytest.approx(direct.difference[0], rel=1e-9)
                assert interval == pytest.approx(direct.difference_interval[0], rel=1e-12)
    findings = {(s.ahead, s.behind): s for s in view.swaps}
    alibi_fire = findings["alibi", "fire"]
    assert [v.verdict for v in alibi_fire.versus] == [RESOLVED, RESOLVED] and alibi_fire.finding == two_lengths.BOTH
    hair = findings.get(("nope", "rotary")) or findings.get(("rotary", "nope"))
    assert hair.versus[1].seeds == [1]  # NoPE has one seed at the longer training length
    assert [v.verdict for v in hair.versus] == [NOT_RESOLVED, NOT_RESOLVED] and hair.finding == two_lengths.NEITHER
    assert two_lengths.Swap(PROTOCOL, "a", "b", [hair.versus[0], alibi_fire.versus[1]], (8, 16)).finding == \
        "resolved at L_train=16 only"
    # a board resolving the order opposite to its ranks (means over unequal seeds) reverses nothing
    assert two_lengths.Swap(PROTOCOL, "a", "b", [alibi_fire.versus[0], alibi_fire.versus[0]], (8, 16)).finding == \
        "same order on the seeds both have (resolved at L_train=16)"
    assert two_lengths.Swap(PROTOCOL, "a", "b", [alibi_fire.versus[1], alibi_fire.versus[1]], (8, 16)).finding == \
        "same order on the seeds both have (resolved at L_train=8)"


def test_tables_csv_and_figure_lines(view):
    view, _, _ = view
    table = two_lengths.markdown(view, PROTOCOL)
    assert "| ALiBi | 1 | 2 |" in table and "| FIRE | 2 | 1 |" in table and "T5" not in table
    assert "| ALiBi | FIRE |" in table and "(1 seed)" in table
    header, rows = two_lengths.csv_rows(view)
    assert len(rows) == 2 * len(view.models)
    row = dict(zip(header, next(r for r in rows if r[0] == "nope" and r[4] == 16)))
    assert row["seeds"] == "1" and float(row["ppl_longest"]) == view.boards[1].mean("nope", PROTOCOL, 512)
    header, rows = two_lengths.swap_csv_rows(view)
    assert len(rows) == 2 * len(view.swaps)
    lines = {label: (before, after, bold) for label, _, before, after, bold in two_lengths.figure_lines(view, PROTOCOL)}
    assert lines["ALiBi"] == (1, 2, True) and lines["NoPE"][2] is False
    assert two_lengths.counts(view, PROTOCOL)[two_lengths.BOTH] >= 1


def record(run_dir, training, evaluation, ppl=None):
    run_dir.mkdir(parents=True)
    for name, seconds in (("trained.json", training), ("evaluated.json", evaluation)):
        (run_dir / name).write_text(json.dumps({"key": {}, "seconds": seconds}))
    if ppl is not None:
        (run_dir / "eval.json").write_text(json.dumps([{"protocol": PROTOCOL, "length": n, "ppl": p}
                                                       for n, p in ((64, 100.0), (2048, ppl))]))


def test_a_further_evaluation_counts_with_the_evaluation(tmp_path):
    record(tmp_path / "alibi-seed1", 100, 50)
    assert run_cost.recorded_seconds(tmp_path / "alibi-seed1") == (100.0, 50.0)
    (tmp_path / "alibi-seed1" / run_cost.FURTHER_EVALUATION).write_text(json.dumps({"key": {}, "seconds": 20}))
    assert run_cost.recorded_seconds(tmp_path / "alibi-seed1") == (100.0, 70.0)


def test_the_estimate_scales_the_measured_run_by_each_model_s_relative_cost(tmp_path):
    other = tmp_path / "other"
    record(other / "alibi-seed1", 100, 50, ppl=150.0)
    record(other / "alibi-seed2", 300, 70, ppl=152.0)  # means: 200 s training, 60 s evaluation
    record(other / "path-seed1", 400, 600, ppl=148.0)
    record(other / "rotary_ntk-seed1", 0, 30, ppl=165.0)  # evaluated on rotary's checkpoint
    (other / "fire-seed1").mkdir(parents=True)  # unfinished: no records
    assert run_cost.model_costs(other) == {"alibi": (200.0, 60.0), "path": (400.0, 600.0), "rotary_ntk": (0.0, 30.0)}
    assert run_cost.recorded_seconds(other / "fire-seed1") is None
    here = {"alibi": (110.0, 240.0), "nope": (90.0, 2000.0)}
    cost = run_cost.estimate([("alibi", 2), ("path", 1), ("rotary_ntk", 1), ("fire", 1), ("nope", 1)], "alibi", here,
                             run_cost.model_costs(other))
    assert cost == {("alibi", 2): 350.0, ("path", 1): 110 * 2 + 240 * 10, ("rotary_ntk", 1): 240 * 0.5,
                    ("fire", 1): 350.0,  # a model the other comparison lacks costs what the measured one did
                    ("nope", 1): 2090.0}  # one run here already: its own cost
    assert run_cost.estimate([("path", 1)], "fire", {"fire": (1.0, 2.0)}, run_cost.model_costs(other)) == {("path", 1): 3.0}
    assert run_cost.best_at_longest(other) == ["path", "alibi", "rotary_ntk"]
    # a model evaluated on another's checkpoint (its training a copy, recorded as next to nothing), measured
    # first, does not price the others' training at nothing
    record(other / "rotary_ntk-seed2", 0.002, 30)
    measured, trains = run_cost.model_costs(other), lambda name: name != "rotary_ntk"
    assert run_cost.measured_model(["fire", "rotary_ntk", "path", "alibi"], measured, trains) == "path"
    assert run_cost.measured_model(["rotary_ntk", "fire"], measured, trains) == "rotary_ntk"


def test_over_the_budget_only_the_models_in_question_keep_every_seed(tmp_path):
    models, seeds = ["alibi", "fire", "nope"], [1, 2, 3]
    cost = {(m, s): 100.0 for m in models for s in seeds}
    finished = [("alibi", 1), ("nope", 2)]
    every = {m: seeds for m in models}
    assert run_cost.seeds_within(None, models, seeds, ["fire"], cost, finished) == every
    assert run_cost.seeds_within(700.0, models, seeds, ["fire"], cost, finished) == every  # 7 runs left
    assert run_cost.seeds_within(699.0, models, seeds, ["fire"], cost, finished) == {
        "alibi": [1], "fire": [1, 2, 3], "nope": [1, 2]}  # a finished run is never dropped
