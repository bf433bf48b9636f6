"""The leaderboard over seeds against a direct computation on synthetic scores (means, standard
deviations, ranks, changes, each seed's paired interval, the verdicts), its tables and CSV, the
families and baselines of the compared encodings, and the records that let a comparison resume."""

import json
import math
import statistics

import numpy as np
import pytest

from kerple_fairseq.analysis import leaderboard
from kerple_fairseq.analysis.leaderboard import NOT_RESOLVED, RESOLVED, Entrant, Versus
from kerple_fairseq.analysis.significance import compare
from kerple_fairseq.errors import UsageError
from kerple_fairseq.evaluation import spans as S
from kerple_fairseq.evaluation.per_token import TokenScores
from kerple_fairseq.evaluation.span_losses import SpanLosses
from kerple_fairseq.experiments.finished_steps import Step, data_bin_fingerprint
from kerple_fairseq.experiments.position_encodings import FAMILIES, POSITION_ENCODINGS

PROTOCOLS = ("early-token-cursed", "last-token")
LENGTHS = (16, 64)
SEEDS = (7, 8, 9)
# model: (extra loss at the training length, extra loss per doubling of the length), seed noise on top
MODELS = {"alibi": (0.0, 0.0), "rotary": (0.02, 0.2), "rotary_yarn": (0.02, 0.05), "kerple_log": (-0.01, -0.002)}


def synthetic_scores(rng):
    """Every model's per-token scores by seed, protocol and length, on shared units (the pairing)."""
    spans = {("early-token-cursed", n): S.early_token_cursed(512, n) for n in LENGTHS}
    spans.update({("last-token", n): S.last_token(np.arange(100, 160), n) for n in LENGTHS})
    difficulty = {key: rng.normal(0, 0.3, len(s)) for key, s in spans.items()}
    scores = {}
    for name, (offset, slope) in MODELS.items():
        for k in range(len(SEEDS)):
            seed_noise = rng.normal(0, 0.01)
            scores[name, k] = {}
            for (protocol, n), s in spans.items():
                mean = 3.0 + offset + slope * math.log2(n / LENGTHS[0]) + seed_noise
                per_span = [-(mean + difficulty[protocol, n][i] + rng.normal(0, 0.5, w.end - w.score_from))
                            for i, w in enumerate(s)]
                scores[name, k][protocol, n] = TokenScores.from_spans(s, per_span)
    return scores


def perplexity(t: TokenScores) -> float:
    return math.exp(-float(np.sum(t.log_prob.astype(np.float64))) / t.log_prob.size)


@pytest.fixture(scope="module")
def board():
    scores = synthetic_scores(np.random.default_rng(0))
    entrants = [Entrant(name, POSITION_ENCODINGS[name].label, POSITION_ENCODINGS[name].family,
                        ["alibi", POSITION_ENCODINGS[name].baseline],
                        {seed: [{"protocol": p, "length": n, "ppl": perplexity(scores[name, k][p, n])}
                                for p in PROTOCOLS for n in LENGTHS] for k, seed in enumerate(SEEDS)})
                for name in MODELS]
    spans = {run: {key: SpanLosses.of(t) for key, t in scored.items()} for run, scored in scores.items()}
    return leaderboard.build(entrants, LENGTHS[0], lambda name, seed: spans[name, SEEDS.index(seed)], samples=400), scores


def test_means_ranks_and_changes_by_direct_computation(board):
    board, scores = board
    for protocol in PROTOCOLS:
        for n in LENGTHS:
            means = {}
            for name in MODELS:
                ppl = [perplexity(scores[name, k][protocol, n]) for k in range(len(SEEDS))]
                means[name] = statistics.mean(ppl)
                assert board.mean(name, protocol, n) == pytest.approx(means[name], rel=1e-12)
                assert board.sd(name, protocol, n) == pytest.approx(statistics.stdev(ppl), rel=1e-9)
            order = sorted(means, key=means.get)
            assert board.ranks(protocol, n) == {name: order.index(name) + 1 for name in MODELS}
        for name in MODELS:
            assert board.change(name, protocol) == pytest.approx(
                board.mean(name, protocol, LENGTHS[-1]) / board.mean(name, protocol, LENGTHS[0]) - 1)


def test_each_seed_is_paired_with_the_same_seed_of_each_reference(board):
    board, scores = board
    pairs = {(v.model, v.reference) for v in board.versus}
    # ALiBi for all but itself; rotary for the rotary family; kerple_log's and rotary's baseline is ALiBi
    assert pairs == {("rotary", "alibi"), ("rotary_yarn", "alibi"), ("rotary_yarn", "rotary"), ("kerple_log", "alibi")}
    for v in board.versus:
        assert v.seeds == list(SEEDS)
        for k in range(len(SEEDS)):
            direct = compare(v.protocol, v.length, [v.reference, v.model],
                             [scores[v.reference, k][v.protocol, v.length], scores[v.model, k][v.protocol, v.length]],
                             samples=400, seed=1)
            assert v.difference[k] == pytest.approx(perplexity(scores[v.model, k][v.protocol, v.length])
                                                    - perplexity(scores[v.reference, k][v.protocol, v.length]), rel=1e-5)
            assert v.bootstrap_interval[k] == pytest.approx(direct.difference_interval[0], rel=1e-12)
            assert v.t_interval[k] == pytest.approx(direct.difference_t_interval[0], rel=1e-12)
            inner = v.bootstrap_inner[k]
            assert v.interval[k] == [min(inner[0], v.t_interval[k][0]), max(inner[1], v.t_interval[k][1])]


def test_verdicts():
    def versus(differences, intervals):
        return Versus("m", "r", "last-token", 16, list(range(len(differences))), differences, intervals, intervals,
                      intervals, 200).verdict

    assert versus([1.0, 2.0], [[0.5, 1.5], [1.0, 3.0]]) == RESOLVED
    assert versus([-1.0, -2.0], [[-1.5, -0.5], [-3.0, -1.0]]) == RESOLVED
    assert versus([1.0, 2.0], [[-0.5, 1.5], [1.0, 3.0]]) == NOT_RESOLVED  # one interval holds zero
    assert versus([1.0, -2.0], [[0.5, 1.5], [-3.0, -1.0]]) == NOT_RESOLVED  # the seeds disagree
    assert versus([0.0], [[0.0, 0.0]]) == NOT_RESOLVED
    assert versus([-0.1], [[0.2, 0.5]]) == NOT_RESOLVED  # a difference outside its own interval is no evidence
    assert versus([0.3], [[0.2, 0.5]]) == RESOLVED  # one seed: its interval alone
    assert versus([], []) == NOT_RESOLVED


def test_synthetic_gaps_are_resolved_and_noise_is_not(board):
    board, _ = board
    verdicts = {(v.model, v.reference, v.protocol, v.length): v.verdict for v in board.versus}
    assert verdicts["rotary", "alibi", "early-token-cursed", 64] == RESOLVED
    assert verdicts["rotary_yarn", "rotary", "early-token-cursed", 64] == RESOLVED
    assert verdicts["rotary", "alibi", "last-token", 16] == NOT_RESOLVED  # 60 targets cannot resolve 2%


def test_tables_and_csv(board):
    board, _ = board
    table = leaderboard.markdown(board, "early-token-cursed").splitlines()
    assert [line.split(" | ")[2] for line in table[2:]] == ["KERPLE-log", "ALiBi", "rotary+YaRN", "rotary"]
    yarn = next(line for line in table if "| rotary+YaRN |" in line)
    mean_sd = f"{board.mean('rotary_yarn', 'early-token-cursed', 64):.2f} ± {board.sd('rotary_yarn', 'early-token-cursed', 64):.2f}"
    assert mean_sd in yarn and "rotary: -" in yarn and yarn.endswith(f"{RESOLVED} |")
    seeds = leaderboard.seed_markdown(board, "last-token", 64).splitlines()
    assert seeds[0].count("interval") == len(SEEDS) and len(seeds) == 2 + 4
    header, rows = leaderboard.csv_rows(board)
    assert len(rows) == len(PROTOCOLS) * len(LENGTHS) * (len(MODELS) + 4)
    row = next(r for r in (dict(zip(header, r)) for r in rows)
               if (r["model"], r["reference"], r["length"], r["protocol"]) == ("rotary_yarn", "rotary", 64, "last-token"))
    assert row["seeds"] == row["compared_seeds"] == "7;8;9"
    v = next(v for v in board.versus if (v.model, v.reference, v.protocol, v.length) == ("rotary_yarn", "rotary", "last-token", 64))
    assert [float(d) for d in row["difference_by_seed"].split(";")] == v.difference
    written = [[float(x) for x in i.split("/")] for i in row["interval_by_seed"].split(";")]
    assert written == [[float(f"{x:.10g}") for x in interval] for interval in v.interval]
    assert all(abs(a - b) <= 1e-9 * abs(b) for w, i in zip(written, v.interval) for a, b in zip(w, i))
    assert "L=16 | L=64" in leaderboard.lengths_markdown(board)


def test_missing_results_are_named_and_a_diverged_model_ranks_last():
    def entrant(name, ppl):
        return Entrant(name, name, FAMILIES[1], [], {1: [{"protocol": "last-token", "length": n, "ppl": ppl}
                                                         for n in (16, 32)]})

    with pytest.raises(UsageError, match="b lacks last-token at L=16"):
        leaderboard.build([entrant("a", 3.0), Entrant("b", "b", FAMILIES[1], [], {1: []})], 16, lambda name, seed: {})
    # a training length that was not evaluated: the board starts at the shortest evaluated length
    board = leaderboard.build([entrant("a", 3.0), entrant("b", float("nan")), entrant("c", 2.0)], 8,
                              lambda name, seed: {})
    assert board.train_length == 16 and board.ranks("last-token", 32) == {"c": 1, "a": 2, "b": 3}
    assert math.isnan(board.sd("a", "last-token", 16))  # one seed has no spread


def test_every_compared_encoding_has_a_family_and_adds_to_its_baseline():
    """A family's baseline is the model it adds to: the same architecture, its flags among the encoding's
    (CoPE's is NoPE: CoPE's positions taken away; a layout of rotary layers, some windowed, chunked or NoPE, is
    compared with rotary in every layer)."""
    for name, encoding in POSITION_ENCODINGS.items():
        assert encoding.family in FAMILIES, name
        baseline = POSITION_ENCODINGS[encoding.baseline]
        if "--layer-positions" in encoding.flags and encoding.baseline == "rotary":
            assert "rotary" in encoding.flags[encoding.flags.index("--layer-positions") + 1], name
        elif encoding.baseline != "alibi" and name != "cope":
            assert baseline.architecture == encoding.architecture and set(baseline.flags) <= set(encoding.flags), name
    assert {POSITION_ENCODINGS[n].baseline for n in ("rotary_ntk", "rotary_yarn", "xpos", "ssmax", "rotary_rerope")} == {"rotary"}
    assert POSITION_ENCODINGS["dape_kerple_log"].baseline == "kerple_log"


def test_a_step_is_finished_only_with_its_key_and_outputs(tmp_path):
    output = tmp_path / "checkpoint.pt"
    step = Step(tmp_path / "done.json", {"flags": ["--seed", "1"], "data": "abc"}, [output])
    assert step.finished() is None
    output.write_bytes(b"x")
    step.complete(12.5)
    assert step.finished() == 12.5 and not list(tmp_path.glob("*.partial"))
    assert Step(step.record, {"flags": ["--seed", "2"], "data": "abc"}, [output]).finished() is None
    # an entry left unchecked may differ; the others may not
    assert Step(step.record, {"flags": ["--seed", "1"], "data": "xyz"}, [output]).finished(unchecked=("data",)) == 12.5
    assert Step(step.record, {"flags": ["--seed", "2"], "data": "xyz"}, [output]).finished(unchecked=("data",)) is None
    assert Step(step.record, {"flags": ["--seed", "1"]}, [output]).finished(unchecked=("flags",)) is None
    output.unlink()
    assert step.finished() is None
    output.write_bytes(b"x")
    step.record.write_text("{not json")  # a record cut short
    assert step.finished() is None
    step.complete(1.0)
    step.forget()
    assert not step.record.exists() and step.finished() is None
    assert json.loads(json.dumps(step.key)) == step.key


def test_the_data_fingerprint_follows_the_files(tmp_path):
    (tmp_path / "dict.txt").write_text("a 1\n")
    first = data_bin_fingerprint(tmp_path)
    assert data_bin_fingerprint(tmp_path) == first
    (tmp_path / "valid.bin").write_bytes(b"\x00")
    assert data_bin_fingerprint(tmp_path) != first


def test_a_model_with_fewer_seeds_is_compared_on_the_seeds_both_have():
    scores = synthetic_scores(np.random.default_rng(1))
    spans = {run: {key: SpanLosses.of(t) for key, t in scored.items()} for run, scored in scores.items()}
    kept = {"alibi": SEEDS, "rotary": SEEDS[:1], "rotary_yarn": SEEDS[1:]}
    entrants = [Entrant(name, POSITION_ENCODINGS[name].label, POSITION_ENCODINGS[name].family,
                        ["alibi", POSITION_ENCODINGS[name].baseline],
                        {seed: [{"protocol": p, "length": n, "ppl": perplexity(scores[name, SEEDS.index(seed)][p, n])}
                                for p in PROTOCOLS for n in LENGTHS] for seed in seeds})
                for name, seeds in kept.items()]
    board = leaderboard.build(entrants, LENGTHS[0], lambda name, seed: spans[name, SEEDS.index(seed)], samples=400)
    assert board.seeds == list(SEEDS) and board.seeds_of("rotary_yarn") == list(SEEDS[1:])
    assert board.mean("rotary_yarn", "last-token", 64) == pytest.approx(
        statistics.mean(perplexity(scores["rotary_yarn", k]["last-token", 64]) for k in (1, 2)), rel=1e-12)
    assert math.isnan(board.sd("rotary", "last-token", 64))
    compared = {(v.model, v.reference): v for v in board.against("rotary_yarn", "early-token-cursed", 64)}
    compared.update({(v.model, v.reference): v for v in board.against("rotary", "early-token-cursed", 64)})
    assert compared["rotary_yarn", "alibi"].seeds == list(SEEDS[1:])
    assert compared["rotary", "alibi"].seeds == list(SEEDS[:1])
    assert compared["rotary_yarn", "rotary"].seeds == []  # no seed in common: no evidence either way
    assert compared["rotary_yarn", "rotary"].verdict == NOT_RESOLVED
    for k in (1, 2):
        direct = compare("early-token-cursed", 64, ["alibi", "rotary_yarn"],
                         [scores["alibi", k]["early-token-cursed", 64], scores["rotary_yarn", k]["early-token-cursed", 64]],
                         samples=400, seed=1)
        assert compared["rotary_yarn", "alibi"].bootstrap_interval[k - 1] == pytest.approx(
            direct.difference_interval[0], rel=1e-12)
    table = leaderboard.markdown(board, "early-token-cursed")
    assert "resolved (2 seeds)" in table and "rotary: no common seed" in table
    seeds = leaderboard.seed_markdown(board, "early-token-cursed", 64).splitlines()
    yarn = next(line for line in seeds if line.startswith("| rotary+YaRN | ALiBi |"))
    assert yarn.split(" | ")[2] == ""  # seed 7 not trained
