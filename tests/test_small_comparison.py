"""scripts/small_comparison.py end to end at a tiny size: two models, two seeds each, trained,
evaluated, tabulated and analysed, every number of the analyses traced back to the evaluations."""

import csv
import json
import sys

import pytest
import torch

from conftest import REPO, run

LENGTHS = (16, 32)


@pytest.fixture(scope="module")
def comparison(sample_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("small-comparison")
    proc = run([sys.executable, REPO / "scripts" / "small_comparison.py", "--wikitext-dir", sample_dir,
                "--data-bin", out / "data-bin", "--out", out / "runs", "--vocab-size", "300",
                "--models", "nope", "alibi", "--seeds", "3", "4", "--train-length", "16",
                "--eval-lengths", *map(str, LENGTHS), "--num-targets", "8", "--num-segments", "2",
                "--updates", "3", "--max-tokens", "256", "--layers", "1", "--width", "16", "--heads", "2"])
    return out / "runs", proc


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
    evaluations = {(name, seed): json.loads((runs / f"{name}-seed{seed}" / "eval.json").read_text())
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
            assert comparison_of_run["labels"] == ["nope", "alibi"] and comparison_of_run["replicate"] == k + 1
            assert comparison_of_run["perplexities"][["nope", "alibi"].index(name)] == pytest.approx(ppl[k], rel=1e-4)
    assert len(rows) == 2 * 2 * len(LENGTHS)
    assert {(s["protocol"], s["length"], s["runs"]) for s in result["across_seeds"]} == {
        (p, n, 2) for p in ("early-token-cursed", "last-token") for n in LENGTHS}
    # the model analyses draw each model's first seed
    kernels = {r["model"] for r in csv.DictReader(open(runs / "analysis" / "kernels.csv"))}
    assert kernels == {"nope", "alibi"}
