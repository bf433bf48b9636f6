"""kerple-eval-lm: each protocol against stock fairseq-eval-lm or a brute-force loop."""

import csv
import json
import math
import os

import pytest
import torch
from fairseq import checkpoint_utils

from conftest import BIN, REPO, run, stock_eval_lm
from console_scripts import run_forked
from helpers import random_tokens, tiny_model
from kerple_fairseq.evaluation.cli import TABLE_HEADER, format_row
from kerple_fairseq.evaluation.scorer import WindowScorer
from kerple_fairseq.evaluation.spans import ScoredSpan

# checkpoints trained with fairseq-train and the installed command in subprocesses
pytestmark = pytest.mark.slow

EVAL_LM = BIN / "kerple-eval-lm"


def kerple_eval_lm(data_bin, checkpoint, *flags, check=True, cwd=REPO, tmp=None, alone=False):
    """Run the installed command, forked (:mod:`console_scripts`), or ``alone`` as a user types it; returns
    (process, records from --results-json)."""
    results = os.path.join(tmp, "results.json") if tmp else None
    args = [data_bin, "--path", checkpoint, "--gen-subset", "valid", "--cpu", "--no-progress-bar", "--max-tokens",
            "4096", *flags, *(["--results-json", results] if results else [])]
    proc = run([EVAL_LM, *args], check=check, cwd=cwd) if alone else run_forked(EVAL_LM.name, args, cwd, check=check)
    records = json.load(open(results)) if results and proc.returncode == 0 else None
    return proc, records


def ckpt(trained, name):
    return trained[name][0] / "checkpoint_last.pt"


@pytest.mark.parametrize("name", ["kerple_log", "sinusoidal"])
def test_early_token_cursed_equals_stock_eval_lm(trained, data_bin, tmp_path, name):
    lengths = [64, 200, 512]
    _, records = kerple_eval_lm(data_bin, ckpt(trained, name), "--lengths", *map(str, lengths), tmp=tmp_path)
    assert [r["length"] for r in records] == lengths
    for record, length in zip(records, lengths):
        # without the override, stock skips every block longer than the checkpoint's 64 positions
        tokens, loss, ppl = stock_eval_lm(data_bin, ckpt(trained, name), length, "--user-dir", "kerple_fairseq",
                                          "--model-overrides", f"{{'max_target_positions': {length}}}")
        assert record["protocol"] == "early-token-cursed"
        assert record["num_tokens"] == tokens
        assert record["ppl"] == pytest.approx(ppl, rel=1e-4)
        assert record["loss"] == pytest.approx(loss, rel=1e-4)
        assert record["ppl"] == pytest.approx(2 ** record["loss"], rel=1e-12)


@pytest.mark.parametrize("name", ["alibi", "sinusoidal"])
def test_sliding_equals_stock_eval_lm_with_context_window(trained, data_bin, tmp_path, name):
    length, context = 96, 64
    _, records = kerple_eval_lm(data_bin, ckpt(trained, name), "--protocol", "sliding", "--lengths", str(length),
                                "--context-window", str(context), tmp=tmp_path)
    tokens, loss, ppl = stock_eval_lm(data_bin, ckpt(trained, name), length, "--context-window", str(context),
                                      "--user-dir", "kerple_fairseq",
                                      "--model-overrides", f"{{'max_target_positions': {length}}}")
    assert records[0]["num_tokens"] == tokens
    assert records[0]["ppl"] == pytest.approx(ppl, rel=1e-4)


def brute_force_last_token(model, stream, targets, length):
    """One forward of exactly the L tokens ending at each target; score only the target."""
    total = 0.0
    with torch.no_grad():
        for t in targets:
            window = stream[t - length + 1: t + 1]
            logits, _ = model(window[None, :-1])
            total += torch.log_softmax(logits[0, -1].float(), dim=-1)[window[-1]].item()
    return total


def test_last_token_equals_brute_force_and_scores_the_same_targets(trained, data_bin, tmp_path):
    from kerple_fairseq.evaluation import spans as S
    from kerple_fairseq.evaluation.loading import token_stream

    lengths, num_targets = [8, 64, 300], 50
    _, records = kerple_eval_lm(data_bin, ckpt(trained, "kerple_log"), "--protocol", "last-token",
                                "--lengths", *map(str, lengths), "--num-targets", str(num_targets), tmp=tmp_path)
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(ckpt(trained, "kerple_log"))], arg_overrides={"data": str(data_bin)})
    model = models[0].eval()
    stream = token_stream(task, str(data_bin), "valid")
    targets = S.last_token_targets(len(stream), max(lengths), num_targets)
    assert targets.min() >= max(lengths) - 1 and len(set(targets.tolist())) == num_targets
    for record, length in zip(records, lengths):
        assert record["num_tokens"] == num_targets
        spans = S.last_token(targets, length)
        assert [w.score_from for w in spans] == targets.tolist(), "the same targets at every length"
        assert all(w.end - w.start == length - 1 for w in spans), "exactly L-1 tokens of context"
        expected = -brute_force_last_token(model, stream, targets, length) / num_targets / math.log(2)
        assert record["loss"] == pytest.approx(expected, rel=1e-5)


def test_protocol_all_and_position_wise_file(trained, data_bin, tmp_path):
    position_file = tmp_path / "positions.csv"
    proc, records = kerple_eval_lm(data_bin, ckpt(trained, "alibi"), "--protocol", "all", "--lengths", "32", "64",
                                   "--num-targets", "40", "--context-window", "16",
                                   "--position-wise", position_file, tmp=tmp_path)
    assert [(r["protocol"], r["length"]) for r in records] == [
        (p, n) for n in (32, 64) for p in ("early-token-cursed", "sliding", "last-token")]
    # the table once, on stdout, a row per result; nothing else from the libraries (no Hydra or
    # torch.jit deprecations, no tensorboardX notice, no INFO lines)
    assert proc.stdout.splitlines() == [TABLE_HEADER] + [format_row(r) for r in records]
    assert proc.stderr == ""
    rows = list(csv.DictReader(open(position_file)))
    by_length = {n: [r for r in rows if int(r["length"]) == n] for n in (32, 64)}
    assert [int(r["position"]) for r in by_length[64]] == list(range(64))
    # position-wise losses, weighted by their counts, average to the protocol's loss
    for n in (32, 64):
        mean = sum(float(r["loss"]) * int(r["count"]) for r in by_length[n]) / sum(int(r["count"]) for r in by_length[n])
        record = next(r for r in records if r["protocol"] == "early-token-cursed" and r["length"] == n)
        assert mean == pytest.approx(record["loss"], rel=1e-6)
    full_blocks = next(r for r in records if r["length"] == 64)["num_tokens"] // 64
    assert int(by_length[64][0]["count"]) in (full_blocks, full_blocks + 1)


def test_long_length_without_an_l_by_l_tensor(trained, data_bin, tmp_path, monkeypatch):
    """L = 8192 on CPU without any L x L tensor: the layers share one vector of per-distance values,
    laid out block by block (blocks of 1024 queries): no laid-out bias has more than 1024 queries."""
    from kerple_core.attention import distance_bias
    from kerple_fairseq.evaluation.cli import cli_main

    dense, lines = [], []
    toeplitz, values = distance_bias.toeplitz, distance_bias.DistanceBias.distance_values

    def recording_toeplitz(*args, **kwargs):
        mask = toeplitz(*args, **kwargs)
        dense.append(tuple(mask.shape))
        return mask

    def recording_values(self, *args):
        per_distance = values(self, *args)
        lines.append(tuple(per_distance.shape))
        return per_distance

    monkeypatch.setattr(distance_bias, "toeplitz", recording_toeplitz)
    monkeypatch.setattr(distance_bias.DistanceBias, "distance_values", recording_values)
    results = tmp_path / "r.json"
    with pytest.raises(SystemExit) as exit_info:
        cli_main([str(data_bin), "--path", str(ckpt(trained, "alibi")), "--gen-subset", "valid", "--cpu",
                  "--no-progress-bar", "--lengths", "8192", "--max-tokens", "16384", "--results-json", str(results)])
    assert exit_info.value.code == 0
    record = json.load(open(results))[0]
    assert record["length"] == 8192 and math.isfinite(record["ppl"])
    assert record["num_tokens"] > 2 * 8192
    assert (4, 8192) in lines and all(h == 4 and n > 1024 for h, n in lines), "[heads, L] values, never [heads, L, L]"
    assert dense and all(s[0] == 4 and s[1] <= 1024 and s[2] <= 8192 for s in dense), dense


def test_learned_positions_beyond_their_table_fail_clearly(trained, data_bin, tmp_path):
    # stock fairseq-eval-lm silently skips every block here and prints Perplexity 1.00
    proc, _ = kerple_eval_lm(data_bin, ckpt(trained, "learned"), "--lengths", "64", "128", check=False, tmp=tmp_path)
    assert proc.returncode != 0
    assert "length 128 exceeds the 64 learned positional embeddings" in proc.stderr
    assert "early-token-cursed        64" in proc.stdout


def one_line_error(proc, expected):
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
    assert expected in proc.stderr, proc.stderr[-2000:]


def test_missing_checkpoint(data_bin, tmp_path):
    proc, _ = kerple_eval_lm(data_bin, tmp_path / "nope.pt", check=False)
    one_line_error(proc, "checkpoint " + str(tmp_path / "nope.pt") + " does not exist")


def test_missing_data(trained, tmp_path):
    proc, _ = kerple_eval_lm(tmp_path / "no-data", ckpt(trained, "alibi"), check=False)
    one_line_error(proc, "is not a fairseq data-bin (no dict.txt)")


def test_corrupt_checkpoint(trained, data_bin, tmp_path):
    broken = tmp_path / "broken.pt"
    broken.write_bytes(ckpt(trained, "alibi").read_bytes()[:5000])
    before = broken.read_bytes()
    proc, _ = kerple_eval_lm(data_bin, broken, check=False)
    one_line_error(proc, f"cannot read checkpoint {broken}")
    assert broken.read_bytes() == before


def test_dictionary_mismatch(trained, data_bin, tmp_path):
    other = tmp_path / "other-bin"
    other.mkdir()
    for name in os.listdir(data_bin):
        (other / name).write_bytes((data_bin / name).read_bytes())
    lines = (data_bin / "dict.txt").read_text().splitlines()
    (other / "dict.txt").write_text("\n".join(lines[:-10]) + "\n")
    proc, _ = kerple_eval_lm(other, ckpt(trained, "alibi"), check=False)
    one_line_error(proc, "the checkpoint does not fit the data-bin's dictionary")


@pytest.mark.parametrize("lengths", [["0"], ["64", "-5"]])
def test_lengths_must_be_positive(trained, data_bin, lengths):
    proc, _ = kerple_eval_lm(data_bin, ckpt(trained, "alibi"), "--lengths", *lengths, check=False)
    one_line_error(proc, "argument --lengths: must be a positive integer")


def test_more_targets_than_the_split_supplies(trained, data_bin):
    proc, _ = kerple_eval_lm(data_bin, ckpt(trained, "alibi"), "--protocol", "last-token", "--lengths", "64",
                             "--num-targets", "10000000", check=False)
    one_line_error(proc, "lower --num-targets or the largest length")


def test_user_dir_naming_the_plugin_is_accepted(trained, data_bin, tmp_path):
    """Started alone, as a user types it, and forked as the other tests run it: the same records."""
    flags = ("--user-dir", "kerple_fairseq", "--lengths", "64")
    for folder in ("alone", "forked"):  # a results file each: neither run can pass on the other's
        (tmp_path / folder).mkdir()
    _, alone = kerple_eval_lm(data_bin, ckpt(trained, "alibi"), *flags, tmp=tmp_path / "alone", alone=True)
    _, forked = kerple_eval_lm(data_bin, ckpt(trained, "alibi"), *flags, tmp=tmp_path / "forked")
    assert alone[0]["num_tokens"] > 0 and alone == forked


def test_position_wise_needs_the_early_token_cursed_protocol(trained, data_bin, tmp_path):
    proc, _ = kerple_eval_lm(data_bin, ckpt(trained, "alibi"), "--protocol", "last-token",
                             "--position-wise", tmp_path / "p.csv", check=False)
    one_line_error(proc, "--position-wise reports the early-token-cursed blocks")


def test_results_file_in_a_missing_directory_fails_before_scoring(trained, data_bin, tmp_path):
    proc, _ = kerple_eval_lm(data_bin, ckpt(trained, "alibi"), "--results-json", tmp_path / "no" / "r.json",
                             check=False)
    one_line_error(proc, "does not exist")


def test_bad_kernel_override_is_reported_as_such(trained, data_bin):
    proc, _ = kerple_eval_lm(data_bin, ckpt(trained, "kerple_log"), "--model-overrides",
                             "{'kernel_param_floor': 0.0}", check=False)
    one_line_error(proc, "--kernel-param-floor must be in (0, 1)")


def test_evaluation_time_window_equals_stock_eval_lm_with_the_override(trained, data_bin, tmp_path):
    """KERPLE's 'windowed@W': the same checkpoint, attention cut to the W most recent keys."""
    checkpoint = ckpt(trained, "kerple_log")
    _, windowed = kerple_eval_lm(data_bin, checkpoint, "--attn-window", "16", "--lengths", "16", "256",
                                 tmp=tmp_path)
    _, plain = kerple_eval_lm(data_bin, checkpoint, "--lengths", "16", "256", tmp=tmp_path)
    tokens, loss, _ = stock_eval_lm(data_bin, checkpoint, 256, "--user-dir", "kerple_fairseq",
                                    "--model-overrides", "{'attn_window': 16}")
    assert windowed[1]["num_tokens"] == tokens and windowed[1]["loss"] == pytest.approx(loss, rel=1e-4)
    # a window as long as the block changes nothing; a shorter one does
    assert windowed[0]["loss"] == pytest.approx(plain[0]["loss"], rel=1e-6)
    assert abs(windowed[1]["loss"] - plain[1]["loss"]) > 1e-4  # float noise is ~1e-7 here


def test_evaluation_time_window_needs_a_plugin_model(trained, data_bin):
    proc, _ = kerple_eval_lm(data_bin, ckpt(trained, "sinusoidal"), "--attn-window", "32", check=False)
    one_line_error(proc, "--attn-window needs a kerple_fairseq model")


def test_per_token_file_holds_every_scored_token(trained, data_bin, tmp_path):
    from kerple_fairseq.analysis.significance import compare
    from kerple_fairseq.evaluation import per_token

    files = {}
    for name in ("alibi", "kerple_log"):
        files[name] = tmp_path / f"{name}.npz"
        _, records = kerple_eval_lm(data_bin, ckpt(trained, name), "--protocol", "all", "--lengths", "64", "200",
                                    "--num-targets", "50", "--per-token", files[name], tmp=tmp_path)
        loaded = per_token.load(str(files[name]))
        assert loaded.split == "valid" and set(loaded.scored) == {(r["protocol"], r["length"]) for r in records}
        for r in records:
            s = loaded.scored[(r["protocol"], r["length"])]
            assert s.log_prob.size == r["num_tokens"] and r["train_length"] == 64
            assert 2.0 ** (-s.log_prob.astype("float64").mean() / math.log(2)) == pytest.approx(r["ppl"], rel=1e-9)
            if r["protocol"] == "early-token-cursed":
                assert (s.target == range(s.target.size)).all() and (s.position == s.target % r["length"]).all()
                assert (s.span == s.target // r["length"]).all()
            else:
                # the target follows its L - 1 tokens of context: the last of L - 1 inputs
                assert (s.position == r["length"] - 2).all() and (s.span == range(50)).all()
    scored = [per_token.load(str(files[n])).scored[("last-token", 200)] for n in ("alibi", "kerple_log")]
    c = compare("last-token", 200, ["alibi", "kerple_log"], scored, samples=200)
    low, high = c.difference_interval[0]
    assert low <= c.difference[0] <= high and c.num_units == 50


def test_scoring_with_an_adaptive_softmax_equals_each_spans_own_forward():
    """ALiBi's WikiText-103 model has an adaptive softmax, which views its targets flat: a batch's
    targets from its first scored position on are given to it contiguous."""
    torch.manual_seed(0)
    model = tiny_model("alibi", "--adaptive-softmax-cutoff", "20,40").eval()
    tokens = random_tokens(batch=1, length=101, seed=2)[0]
    inputs, targets = tokens[:-1], tokens[1:]
    spans = [ScoredSpan(0, 50, 10), ScoredSpan(50, 100, 60)]  # one batch, scored from its 11th position
    scores = WindowScorer(model, inputs, targets, max_tokens=200, device="cpu", progress=False).score(spans)
    with torch.no_grad():
        for span, got in zip(spans, scores):
            span_targets = targets[None, span.start:span.end]
            lprobs = model.get_normalized_probs(model(inputs[None, span.start:span.end]), log_probs=True,
                                                sample={"target": span_targets})
            expected = lprobs[0].gather(-1, span_targets[0, :, None])[span.score_from - span.start:, 0]
            torch.testing.assert_close(torch.from_numpy(got), expected, rtol=0, atol=1e-5)
