"""scripts/small_comparison.py end to end at a tiny size, on the head of the WikiText-103 sample: two
models, two seeds each, trained, evaluated, tabulated, ranked and analysed, every number of the
leaderboard and the analyses traced back to the evaluations; a run killed after its first model goes
on where it stopped and ends with the same leaderboard, and a changed option redoes only what it
changes; the runs carried into another checkout with only the files git keeps of them are ranked
again without training."""

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from kerple_fairseq.evaluation import span_losses

from conftest import REPO, run
from console_scripts import run_forked

LENGTHS = (16, 32)
SCRIPT = REPO / "scripts" / "small_comparison.py"


def tiny_comparison(wikitext, out, *options, train_length=16, eval_lengths=LENGTHS, seeds=(3, 4), data_bin=None):
    """The comparison at a tiny size, of NoPE and ALiBi for each of ``seeds``, into ``out``/runs; without
    ``eval_lengths``, at its default lengths (1x to 32x); preprocessed into ``data_bin`` (default ``out``/data-bin)."""
    return [sys.executable, SCRIPT, "--wikitext-dir", wikitext, "--data-bin", data_bin or out / "data-bin",
            "--out", out / "runs",
            "--vocab-size", "300", "--models", "nope", "alibi", "--seeds", *map(str, seeds), "--train-length", str(train_length),
            *(["--eval-lengths", *map(str, eval_lengths)] if eval_lengths else []), "--num-targets", "8",
            "--num-segments", "2", "--updates", "3", "--max-tokens", "256", "--layers", "1", "--width", "16",
            "--heads", "2", *options]


def run_comparison(cmd, check=True):
    """The comparison's command line ``cmd`` (``[python, script, arguments]``) forked (:mod:`console_scripts`):
    the script's own imports done once; the trainings and evaluations it starts are processes of their own."""
    return run_forked(str(cmd[1]), cmd[2:], REPO, check=check)


@pytest.fixture(scope="module")
def comparison(wikitext_head, tmp_path_factory):
    out = tmp_path_factory.mktemp("small-comparison")
    proc = run_comparison(tiny_comparison(wikitext_head, out))
    return out / "runs", proc


@pytest.fixture(scope="module")
def comparison_data_bin(comparison):
    """The fixture comparison's data-bin, which the comparisons run here after it read rather than preprocess
    the same text again (a comparison records the data-bin's fingerprint with each run)."""
    return comparison[0].parent / "data-bin"


@pytest.mark.slow
def test_every_model_is_trained_once_per_seed(comparison):
    runs, proc = comparison
    for name, arch in (("nope", "transformer_lm_kerple"), ("alibi", "transformer_lm_alibi")):
        for seed in (3, 4):
            checkpoint = runs / f"{name}-seed{seed}" / "checkpoint_last.pt"
            cfg = torch.load(checkpoint, map_location="cpu", weights_only=True)["cfg"]
            assert (cfg["model"]["_name"], cfg["common"]["seed"], cfg["model"]["bias_kernel"]) == (
                arch, seed, name.replace("nope", "none"))
    table = (runs / "results.md").read_text()
    assert "seeds 3, 4" in table and "| alibi-seed4 | last-token |" in table


@pytest.mark.slow
def test_analyses_group_the_seeds_of_each_model(comparison):
    runs, _ = comparison
    label = {"nope": "NoPE", "alibi": "ALiBi"}  # the analyses name the models as the tables do
    evaluations = {(label[name], seed): json.loads((runs / f"{name}-seed{seed}" / "eval.json").read_text())
                   for name in ("nope", "alibi") for seed in (3, 4)}
    rows = {(r["model"], r["protocol"], int(r["length"])): r
            for r in csv.DictReader(open(runs / "analysis" / "extrapolation.csv"))}
    result = json.loads((runs / "analysis" / "compare.json").read_text())
    for (name, protocol, length), row in rows.items():
        ppl = [next(r["ppl"] for r in evaluations[name, seed] if (r["protocol"], r["length"]) == (protocol, length))
               for seed in (3, 4)]
        assert float(row["ppl"]) == pytest.approx(sum(ppl) / 2) and int(row["runs"]) == 2
        assert (float(row["min"]), float(row["max"])) == (min(ppl), max(ppl))
        for k, comparison_of_run in enumerate(c for c in result["comparisons"]
                                              if (c["protocol"], c["length"]) == (protocol, length)):
            assert comparison_of_run["labels"] == ["NoPE", "ALiBi"] and comparison_of_run["replicate"] == k + 1
            assert comparison_of_run["perplexities"][["NoPE", "ALiBi"].index(name)] == pytest.approx(ppl[k], rel=1e-4)
    assert len(rows) == 2 * 2 * len(LENGTHS)
    assert {(s["protocol"], s["length"], s["runs"]) for s in result["across_seeds"]} == {
        (p, n, 2) for p in ("early-token-cursed", "last-token") for n in LENGTHS}
    # the model analyses draw each model's first seed
    kernels = {r["model"] for r in csv.DictReader(open(runs / "analysis" / "kernels.csv"))}
    assert kernels == {"NoPE", "ALiBi"}


@pytest.mark.slow
def test_the_leaderboard_is_the_evaluations_over_seeds(comparison):
    runs, proc = comparison
    rows = list(csv.DictReader(open(runs / "leaderboard.csv")))
    for name in ("nope", "alibi"):
        evaluations = [json.loads((runs / f"{name}-seed{seed}" / "eval.json").read_text()) for seed in (3, 4)]
        for r in evaluations[0]:
            ppl = [next(e["ppl"] for e in records if (e["protocol"], e["length"]) == (r["protocol"], r["length"]))
                   for records in evaluations]
            row = next(x for x in rows if (x["model"], x["protocol"], int(x["length"]), x["reference"]) ==
                       (name, r["protocol"], r["length"], ""))
            assert [float(p) for p in row["ppl_by_seed"].split(";")] == ppl
            assert float(row["mean"]) == pytest.approx(sum(ppl) / 2)
    compared = json.loads((runs / "analysis" / "compare.json").read_text())["comparisons"]
    for row in (x for x in rows if x["reference"] == "alibi"):
        # compare's baseline is nope, so its differences are alibi's to nope: the leaderboard's, negated
        seeds = [c for c in compared if (c["protocol"], c["length"]) == (row["protocol"], int(row["length"]))]
        assert [float(d) for d in row["difference_by_seed"].split(";")] == pytest.approx(
            [-c["difference"][0] for c in seeds], rel=1e-9)
    assert (runs / "leaderboard.png").stat().st_size > 0
    board = (runs / "leaderboard.md").read_text()
    assert board.startswith("# Leaderboard: 2 position encodings, seeds 3, 4") and "## last-token at L=32, seed by seed" in board
    assert re.search(r"cost: nope-seed3 took \d+ s to train and \d+ s to evaluate; 1 of 4 runs are finished, the other 3 "
                     r"need about [\d.]+ h on this machine \(each model costing what nope did, or the model's own runs here where "
                     r"it has some\)\n", proc.stdout)
    assert re.search(r"1 of 4 models trained and evaluated; about \d+ min left", proc.stdout)
    assert "4 of 4 models trained and evaluated\n" in proc.stdout


def modified(runs):
    return {p.relative_to(runs): p.stat().st_mtime_ns for p in runs.glob("*-seed*/*") if p.suffix in (".pt", ".npz")}


@pytest.mark.slow
def test_a_killed_comparison_goes_on_where_it_stopped(comparison, comparison_data_bin, wikitext_head, tmp_path):
    cmd = tiny_comparison(wikitext_head, tmp_path, "--analyses", data_bin=comparison_data_bin)
    first = tmp_path / "runs" / "nope-seed3" / "evaluated.json"
    proc = subprocess.Popen([str(c) for c in cmd], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 600
    while not first.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the script and the fairseq-train it started
    proc.wait()
    assert first.exists() and not (tmp_path / "runs" / "leaderboard.md").exists()
    runs = tmp_path / "runs"
    before = {k: v for k, v in modified(runs).items() if k.parts[0] == "nope-seed3"}

    resumed = run_comparison(cmd)
    assert "nope-seed3 is trained so already" in resumed.stdout and "nope-seed3 is evaluated so already" in resumed.stdout
    assert "none), seed 3" not in resumed.stdout and "training alibi (--arch transformer_lm_alibi), seed 3" in resumed.stdout
    assert resumed.stdout.count("training ") == 3
    assert {k: v for k, v in modified(runs).items() if k.parts[0] == "nope-seed3"} == before
    uninterrupted, _ = comparison
    assert (runs / "leaderboard.csv").read_text() == (uninterrupted / "leaderboard.csv").read_text()
    assert (runs / "leaderboard.md").read_text().split("\n## ")[1:] == (
        uninterrupted / "leaderboard.md").read_text().split("\n## ")[1:]

    finished = modified(runs)
    (runs / "leaderboard.csv").unlink()
    again = run(cmd)  # nothing left to do; started as a user types it, its leaderboard that of the forked runs
    assert "training" not in again.stdout and "evaluating" not in again.stdout and modified(runs) == finished
    assert (runs / "leaderboard.csv").read_text() == (uninterrupted / "leaderboard.csv").read_text()
    # a changed option redoes what it changes, run by run: here for the second seed of each model
    fewer_targets = run_comparison(tiny_comparison(wikitext_head, tmp_path, "--analyses", "--num-targets", "6",
                                                   seeds=[4], data_bin=comparison_data_bin))
    assert "training" not in fewer_targets.stdout and fewer_targets.stdout.count("evaluating ") == 2
    for kept in (runs / "nope-seed4" / "span-losses.npz", runs / "alibi-seed4" / "span-losses.npz"):  # written again
        assert {n: s.count.size for (p, n), s in span_losses.load(str(kept)).items() if p == "last-token"} == {
            n: 6 for n in LENGTHS}
    more_updates = run_comparison(tiny_comparison(wikitext_head, tmp_path, "--analyses", "--updates", "4", seeds=[4],
                                                  data_bin=comparison_data_bin))
    assert more_updates.stdout.count("training ") == 2
    record = json.loads((runs / "alibi-seed4" / "trained.json").read_text())
    assert record["key"]["fairseq-train"][-1] == "4"
    assert record["losses"]["train"]["num_updates"] == 4 and 0 < record["losses"]["train"]["loss"] < 20


def csv_rows(path):
    return list(csv.DictReader(open(path)))


def trainings(proc):
    return re.findall(r"^\[[\d:]+\] (training .*)$", proc.stdout, re.M)


@pytest.mark.slow
def test_a_second_training_length_under_a_budget_resumes_adds_seeds_and_is_seen_with_the_first(
        comparison, comparison_data_bin, wikitext_head, tmp_path):
    """The comparison at another --train-length, its lengths by default 1x to 32x, with --other-length the
    first one and a budget too small for every seed: killed after its first run, it goes on where it stopped
    with every seed of the model kept (ALiBi) and the first of the other; the same command without the budget
    adds the missing seed alone; both-lengths.* ranks both leaderboards' means and compares each swap."""
    first, _ = comparison
    budget = ("--other-length", first, "--budget-hours", "1e-6", "--every-seed-for", "alibi", "--every-seed-top", "0",
              "--analyses", "extrapolation")
    cmd = tiny_comparison(wikitext_head, tmp_path, *budget, train_length=8, eval_lengths=None, data_bin=comparison_data_bin)
    runs = tmp_path / "runs"
    proc = subprocess.Popen([str(c) for c in cmd], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 600
    while not (runs / "nope-seed3" / "evaluated.json").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (runs / "nope-seed3" / "evaluated.json").exists() and not (runs / "leaderboard.md").exists()

    resumed = run_comparison(cmd)
    assert "nope-seed3 is trained so already" in resumed.stdout and len(trainings(resumed)) == 2
    assert re.search(r"over --budget-hours 1e-06: every seed of alibi \(.*\), seed 3 of the other 1 models: about "
                     r"[\d.]+ h for the 2 runs left", resumed.stdout)
    assert sorted(p.name for p in runs.glob("*-seed*")) == ["alibi-seed3", "alibi-seed4", "nope-seed3"]
    lengths = [8, 16, 32, 64, 128, 256]
    assert [r["length"] for r in json.loads((runs / "nope-seed3" / "eval.json").read_text())][::2] == lengths
    board = csv_rows(runs / "leaderboard.csv")
    assert {(r["model"], r["seeds"]) for r in board} == {("nope", "3"), ("alibi", "3;4")}
    assert {r["compared_seeds"] for r in board if r["reference"] == "alibi"} == {"3"}
    assert "Trained with fewer seeds (--budget-hours): NoPE;" in (runs / "leaderboard.md").read_text()

    # both lengths: each board's means at its longest length, ranked; a swap compared at both lengths
    both = csv_rows(runs / "both-lengths.csv")
    for directory, train_length, longest in ((first, 16, 32), (runs, 8, 256)):
        means = {(r["model"], r["protocol"]): float(r["mean"]) for r in csv_rows(directory / "leaderboard.csv")
                 if int(r["length"]) == longest and not r["reference"]}
        mine = {(r["model"], r["protocol"]): r for r in both if int(r["train_length"]) == train_length}
        assert mine.keys() == means.keys()
        for (model, protocol), r in mine.items():
            assert float(r["ppl_longest"]) == means[model, protocol] and int(r["longest"]) == longest
            other = means[{"nope": "alibi", "alibi": "nope"}[model], protocol]
            assert int(r["rank_longest"]) == 1 + (other < means[model, protocol])
    swaps = csv_rows(runs / "both-lengths-swaps.csv")
    for protocol in ("early-token-cursed", "last-token"):
        ranks = {int(r["train_length"]): r["rank_longest"] for r in both if r["model"] == "nope" and r["protocol"] == protocol}
        assert (ranks[8] != ranks[16]) == any(s["protocol"] == protocol for s in swaps)
    for s in swaps:
        assert s["compared_seeds"] == ("3;4" if s["train_length"] == "16" else "3")
    assert (runs / "both-lengths.png").stat().st_size > 0
    assert "# Two training lengths: 2 position encodings" in (runs / "both-lengths.md").read_text()

    more = run_comparison(tiny_comparison(wikitext_head, tmp_path, "--other-length", first, "--analyses",
                                          "extrapolation", train_length=8, eval_lengths=None,
                                          data_bin=comparison_data_bin))
    assert trainings(more) == ["training nope (--arch transformer_lm_kerple --bias-kernel none), seed 4, 3 updates"]
    assert "3 of 4 models trained and evaluated\n" in more.stdout  # alibi-seed4, finished, is no time left
    assert "over --budget-hours" not in more.stdout
    assert {(r["model"], r["seeds"]) for r in csv_rows(runs / "leaderboard.csv")} == {("nope", "3;4"), ("alibi", "3;4")}


KEPT = ("trained.json", "evaluated.json", "eval.json", "span-losses.npz")


def test_git_keeps_what_stands_for_a_run_and_nothing_heavier():
    run_files = ["checkpoint_last.pt", "checkpoint1.pt", "per-token.npz", "position-wise.csv", "train.log", *KEPT]
    paths = [f"results/leaderboard/alibi-seed1/{name}" for name in run_files] + [
        "results/leaderboard/tensorboard/alibi-seed1/events.out", "results/leaderboard/analysis/extrapolation.png",
        "results/leaderboard/leaderboard.md", "results/leaderboard/leaderboard.png", "results/leaderboard/results.md"]
    proc = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=REPO, capture_output=True, text=True)
    ignored = set(proc.stdout.split())
    assert ignored == set(paths[:5] + paths[-5:-3])


@pytest.mark.slow
def test_runs_carried_without_checkpoints_are_ranked_again_without_training(comparison, wikitext_head, tmp_path):
    """What git keeps of a finished comparison, in a new checkout with its own data-bin: the same
    command trains and evaluates nothing and writes the same leaderboard; the analyses that read
    checkpoints or per-token files say so in one line; a changed evaluation option trains again."""
    finished, _ = comparison
    carried = tmp_path / "runs"
    for record in finished.glob("*-seed*/trained.json"):
        (carried / record.parent.name).mkdir(parents=True)
        for name in KEPT:
            shutil.copyfile(record.parent / name, carried / record.parent.name / name)
    again = run_comparison(tiny_comparison(wikitext_head, tmp_path, "--analyses", "extrapolation"))
    assert "training" not in again.stdout and "evaluating" not in again.stdout
    assert again.stdout.count("is kept without its checkpoint, trained and evaluated so") == 4
    assert (carried / "leaderboard.csv").read_text() == (finished / "leaderboard.csv").read_text()
    assert (carried / "leaderboard.md").read_text() == (finished / "leaderboard.md").read_text()
    assert (carried / "analysis" / "extrapolation.csv").read_text() == (
        finished / "analysis" / "extrapolation.csv").read_text()

    needs_checkpoints = run_comparison(tiny_comparison(wikitext_head, tmp_path, "--analyses", "kernels"), check=False)
    assert needs_checkpoints.returncode == 2 and len(needs_checkpoints.stderr.strip().splitlines()) == 1
    assert re.fullmatch(r"small_comparison: error: kerple-analyze kernels reads \S+checkpoint_last.pt \(and 1 more\), "
                        r"absent: a run kept without its checkpoint .*", needs_checkpoints.stderr.strip())
    fewer_targets = run_comparison(tiny_comparison(wikitext_head, tmp_path, "--analyses", "--num-targets", "6",
                                                   seeds=[4]))
    assert fewer_targets.stdout.count("training ") == 2 and fewer_targets.stdout.count("evaluating ") == 2


@pytest.mark.slow
def test_models_trained_alike_share_one_checkpoint_across_invocations(comparison_data_bin, wikitext_head, tmp_path):
    """rotary_rerope is rotary evaluated with ReRoPE: rotary, asked for later, is its checkpoint's copy."""
    def comparison(*models):
        return run_comparison([
            sys.executable, SCRIPT, "--wikitext-dir", wikitext_head, "--data-bin", comparison_data_bin, "--out",
            tmp_path / "runs", "--vocab-size", "300", "--models", *models, "--train-length", "16", "--eval-lengths",
            "16", "32", "--num-targets", "8", "--updates", "3", "--max-tokens", "256", "--layers", "1", "--width", "16",
            "--heads", "2", "--analyses"]).stdout

    assert "training rotary_rerope" in comparison("rotary_rerope")
    both = comparison("rotary", "rotary_rerope")
    assert "rotary is trained as rotary_rerope-seed1 is" in both and "training" not in both
    runs = tmp_path / "runs"
    assert (runs / "rotary-seed1" / "checkpoint_last.pt").read_bytes() == (
        runs / "rotary_rerope-seed1" / "checkpoint_last.pt").read_bytes()
    board = (runs / "leaderboard.md").read_text()
    assert "| rotary+ReRoPE |" in board and "rotary: " in board  # compared with its baseline, rotary


@pytest.mark.slow
def test_models_all_stands_alone(wikitext_head, tmp_path):
    proc = run_comparison([sys.executable, SCRIPT, "--wikitext-dir", wikitext_head, "--out", tmp_path, "--models", "all",
                           "nope"], check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "small_comparison: error: --models all stands alone: it names every model"


@pytest.mark.slow
def test_a_wrong_other_length_or_budget_is_refused_before_any_run(comparison, wikitext_head, tmp_path):
    first, _ = comparison
    cases = [(("--other-length", first), f"--other-length {first} must hold evaluated runs of these models trained at "
                                         "one length other than 16; it holds training lengths 16"),
             (("--other-length", tmp_path), f"--other-length {tmp_path} must hold evaluated runs of these models trained "
                                            "at one length other than 16; it holds no evaluated run of them"),
             (("--other-length", tmp_path / "absent"), f"--other-length {tmp_path / 'absent'} is not a directory: give "
                                                       "the --out of a comparison at another training length"),
             (("--budget-hours", "0"), "--budget-hours must be positive"),
             (("--train-length", "1"), "--train-length must be 2 or more: one token has no other position, and "
                                       "ReRoPE scales queries by log(i + 1) / log(training length)")]
    for options, message in cases:
        proc = run_comparison(tiny_comparison(wikitext_head, tmp_path, *options), check=False)
        assert proc.returncode == 2 and proc.stderr.strip() == f"small_comparison: error: {message}"
        assert not (tmp_path / "runs").exists()


def test_the_last_losses_of_a_training_log():
    from kerple_fairseq.experiments.small_comparison import last_losses
    log = "\n".join([
        "2026-11-29 06:57:27 | INFO | fairseq_cli.train | {'common': {'log_interval': 25}, 'criterion': 'loss'}",
        "2026-11-29 06:57:28 | INFO | train_inner | epoch 001:     25 / 153 loss=10.873, ppl=1875.86, wps=29206.5, "
        "num_updates=25, lr=0.0004",
        "2026-11-29 06:57:29 | INFO | train_inner | epoch 001:     50 / 153 loss=9.5, ppl=724.08, num_updates=50",
        "2026-11-29 06:57:30 | INFO | train | epoch 001 | loss 9.59 | ppl 770.6 | num_updates 153 | lr 0.002",
        "2026-11-29 06:57:31 | INFO | valid | epoch 001 | valid on 'valid' subset | loss 8.125 | ppl 279.2 | "
        "num_updates 153"])
    assert last_losses(log) == {"train_inner": {"loss": 9.5, "num_updates": 50},
                                "train": {"loss": 9.59, "num_updates": 153},
                                "valid": {"loss": 8.125, "num_updates": 153}}
    assert last_losses("no losses logged") == {}

