"""scripts/reproduce-wikitext-103.sh end to end with the CPU smoke preset, and its table."""

import sys

import pytest

from kerple_fairseq.experiments.reproduction import table

from conftest import REPO, run


@pytest.mark.slow
def test_smoke_run_trains_evaluates_and_tabulates_both_kernels(data_bin, tmp_path):
    run([sys.executable, REPO / "scripts" / "reproduce_wikitext_103.py", "--data", data_bin, "--out", tmp_path,
         "--tiny", "--train-lengths", "64", "--eval-lengths", "64", "128", "--num-targets", "20",
         "--max-update", "3"])
    table = (tmp_path / "results.md").read_text()
    for kernel in ("ALiBi", "KERPLE-log"):
        for protocol in ("early-token-cursed", "last-token"):
            row = next(line for line in table.splitlines() if line.startswith(f"| {kernel} (this run) | 64 | {protocol} |"))
            cells = [c.strip() for c in row.strip("|").split("|")][3:]
            assert len(cells) == 2 and all(float(c) > 1 for c in cells), row
    for kernel in ("alibi", "kerple_log"):
        assert (tmp_path / f"{kernel}-64" / "checkpoint_last.pt").is_file()


def test_table_puts_the_published_numbers_beside_ours():
    records = [{"protocol": p, "length": n, "ppl": 20.0 + n / 1000} for p in ("early-token-cursed", "last-token")
               for n in (512, 1024, 1536, 2048, 3072)]
    text = table({(512, "kerple_log"): records, (2048, "alibi"): records}, [512, 1024, 1536, 2048, 3072])
    lines = text.splitlines()
    assert "| KERPLE-log (KERPLE Table 10) | 512 | early-token-cursed | 19.69 | 18.76 | 18.37 | 18.29 | 18.24 |" in lines
    assert "| ALiBi (KERPLE Table 10) | 2048 | early-token-cursed |  |  |  | 17.91 | 17.64 |" in lines
    assert "| KERPLE-log (this run) | 512 | last-token | 20.51 | 21.02 | 21.54 | 22.05 | 23.07 |" in lines
