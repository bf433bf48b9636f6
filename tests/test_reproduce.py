"""scripts/reproduce-wikitext-103.sh end to end with the CPU smoke preset (Table 10's pair, and a
positional baseline over two seeds), and its table."""

import json
import shlex
import sys

import torch

import pytest

from kerple_fairseq.experiments.reproduction import table

from conftest import BIN, REPO, run


@pytest.mark.slow
def test_smoke_run_trains_evaluates_and_tabulates_both_kernels(data_bin, tmp_path):
    run([sys.executable, REPO / "scripts" / "reproduce_wikitext_103.py", "--data", data_bin, "--out", tmp_path,
         "--tiny", "--train-lengths", "64", "--eval-lengths", "64", "128", "--num-targets", "20",
         "--max-update", "3"])
    table = (tmp_path / "results.md").read_text()
    for kernel in ("ALiBi", "KERPLE-log"):
        for protocol in ("early-token-cursed", "last-token"):
            row = next(line for line in table.splitlines()
                       if line.startswith(f"| {kernel} (this run, seed 1) | 64 | {protocol} |"))
            cells = [c.strip() for c in row.strip("|").split("|")][3:]
            assert len(cells) == 2 and all(float(c) > 1 for c in cells), row
    for kernel in ("alibi", "kerple_log"):
        assert (tmp_path / f"{kernel}-64" / "checkpoint_last.pt").is_file()


def test_table_puts_the_published_numbers_beside_ours():
    records = [{"protocol": p, "length": n, "ppl": 20.0 + n / 1000} for p in ("early-token-cursed", "last-token")
               for n in (512, 1024, 1536, 2048, 3072)]
    text = table({(512, "kerple_log", 1): records, (2048, "alibi", 1): records, (2048, "alibi", 2): records},
                 [512, 1024, 1536, 2048, 3072])
    lines = text.splitlines()
    assert "| KERPLE-log (KERPLE Table 10) | 512 | early-token-cursed | 19.69 | 18.76 | 18.37 | 18.29 | 18.24 |" in lines
    assert "| ALiBi (KERPLE Table 10) | 2048 | early-token-cursed |  |  |  | 17.91 | 17.64 |" in lines
    assert "| KERPLE-log (this run, seed 1) | 512 | last-token | 20.51 | 21.02 | 21.54 | 22.05 | 23.07 |" in lines
    assert sum("(KERPLE Table 10) | 2048 |" in line for line in lines) == 1  # once, after the first seed
    assert lines.index("| ALiBi (KERPLE Table 10) | 2048 | early-token-cursed |  |  |  | 17.91 | 17.64 |") == \
        next(i for i, line in enumerate(lines) if line.startswith("| ALiBi (this run, seed 1) | 2048 | last-token")) + 1


@pytest.mark.slow
def test_baselines_and_seeds(data_bin, tmp_path):
    """--models puts a positional baseline on the same architecture as the kernels, --seeds trains each
    once per seed, and the compare command the script prints reports the spread over the seeds."""
    proc = run([sys.executable, REPO / "scripts" / "reproduce_wikitext_103.py", "--data", data_bin, "--out", tmp_path,
                "--tiny", "--models", "sinusoidal", "kerple_log", "--seeds", "1", "2", "--train-lengths", "32",
                "--eval-lengths", "32", "64", "--num-targets", "10", "--max-update", "2"])
    for model, arch in (("sinusoidal", "transformer_lm_sinusoidal"), ("kerple_log", "transformer_lm_kerple")):
        for seed, directory in ((1, f"{model}-32"), (2, f"{model}-32-seed2")):
            cfg = torch.load(tmp_path / directory / "checkpoint_last.pt", map_location="cpu", weights_only=True)["cfg"]
            assert (cfg["model"]["_name"], cfg["common"]["seed"], cfg["task"]["tokens_per_sample"]) == (arch, seed, 32)
            assert (tmp_path / directory / "per-token.npz").is_file()
    table = (tmp_path / "results.md").read_text()
    assert "| sinusoidal (this run, seed 2) | 32 | early-token-cursed |" in table
    command = next(line for line in proc.stdout.splitlines() if "kerple-analyze compare" in line).strip()
    assert command.endswith(f"--labels sinusoidal sinusoidal kerple_log kerple_log --out {tmp_path / 'compare-32'}")
    run([BIN / "kerple-analyze", *shlex.split(command)[1:]])
    result = json.loads((tmp_path / "compare-32" / "compare.json").read_text())
    assert len(result["comparisons"]) == 2 * 2 * 2  # protocols x lengths x seeds
    assert {(s["protocol"], s["length"], s["runs"]) for s in result["across_seeds"]} == {
        (p, n, 2) for p in ("early-token-cursed", "last-token") for n in (32, 64)}


@pytest.mark.slow
def test_rotary_scalings_evaluate_the_rotary_checkpoint(data_bin, tmp_path):
    """rotary_ntk is rotary trained, scaled at evaluation: one training, a copy of its checkpoint, and
    the scaling only in the evaluation."""
    proc = run([sys.executable, REPO / "scripts" / "reproduce_wikitext_103.py", "--data", data_bin, "--out", tmp_path,
                "--tiny", "--models", "rotary", "rotary_ntk", "--train-lengths", "32", "--eval-lengths", "32", "64",
                "--num-targets", "10", "--max-update", "2"])
    assert proc.stderr.count("train_wikitext_103.py") == 1
    assert "rotary_ntk is trained as rotary-32 is: evaluating a copy of its checkpoint" in proc.stderr
    evaluated = next(n for n in ("checkpoint_best.pt", "checkpoint_last.pt") if (tmp_path / "rotary-32" / n).is_file())
    assert (tmp_path / "rotary-32" / evaluated).read_bytes() == (tmp_path / "rotary_ntk-32" / evaluated).read_bytes()
    evaluations = {m: json.loads((tmp_path / f"{m}-32" / "eval.json").read_text()) for m in ("rotary", "rotary_ntk")}
    ppl = {m: {(r["protocol"], r["length"]): r["ppl"] for r in records} for m, records in evaluations.items()}
    assert ppl["rotary"]["early-token-cursed", 32] == ppl["rotary_ntk"]["early-token-cursed", 32]  # s = 1
    assert ppl["rotary"]["early-token-cursed", 64] != ppl["rotary_ntk"]["early-token-cursed", 64]  # s = 2
