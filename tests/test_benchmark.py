"""scripts/benchmark.py --quick: every model, length and phase timed against `none` in one run,
and memory measured per model (the figures themselves are for the README, not asserted)."""

import json
import statistics
import sys

import pytest

from conftest import REPO, run


@pytest.mark.slow
def test_quick_benchmark_reports_ratios_to_none(tmp_path):
    out = tmp_path / "bench.json"
    proc = run([sys.executable, REPO / "scripts" / "benchmark.py", "--quick", "--cpu", "--json", out])
    results = json.loads(out.read_text())
    models = ["none", "sinusoidal", "alibi", "kerple_log"]
    timing = results["timing"]
    assert {(r["phase"], r["length"], r["model"]) for r in timing} == \
        {(p, n, m) for p in ("train", "eval") for n in (128, 256) for m in models}
    for r in timing:
        none = next(x for x in timing if (x["phase"], x["length"], x["model"]) == (r["phase"], r["length"], "none"))
        assert len(r["rounds_ms"]) == 3 and r["ms"] == pytest.approx(statistics.median(r["rounds_ms"]))
        # each round's time over none's in the same round, then the median
        paired = sorted(t / base for t, base in zip(r["rounds_ms"], none["rounds_ms"]))
        assert r["ratio"] == pytest.approx(paired[1])
        assert (r["ratio"] == 1.0) == (r["model"] == "none")
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * r["length"] / (r["ms"] / 1000))
        assert r["ms"] > 0
    memory = results["memory"]
    assert [(r["length"], r["model"]) for r in memory] == [(2048, m) for m in models]
    assert all(r["peak_mib"] > 0 for r in memory) and memory[0]["ratio"] == 1.0
    assert "x1.000" in proc.stdout and "memory L=2048" in proc.stdout
    assert results["largest_length"] == {}, "one memory length: no fit"
    generation = results["generation"]
    assert [(r["cache"], r["tokens"]) for r in generation] == [(128, 256), (128, 512), (0, 256), (0, 512)]
    assert all(r["tokens_per_s"] > 0 for r in generation)


def test_models_name_a_kernel_and_optionally_dape_or_cope_over_it():
    import argparse

    from kerple_fairseq.experiments.benchmark import build, model_flags

    args = argparse.Namespace(layers=1, width=32, heads=4, lengths=[128], memory_lengths=[], model_args=[], vocab=50)
    flags = model_flags("alibi+dape", args)
    assert flags[:6] == ["--arch", "transformer_lm_kerple", "--bias-kernel", "alibi", "--dape", "mlp"]
    assert model_flags("fire+dape-conv", args)[3:6] == ["fire", "--dape", "conv"]
    assert "--dape" not in model_flags("fox", args)
    assert model_flags("none+cope", args)[3:5] == ["none", "--cope"]
    model = build("kerple_log+dape-conv", args, "cpu")
    assert model.decoder.layers[0].self_attn.score_transform is not None
    with pytest.raises(ValueError, match="unknown model 'alibi\\+rope'"):
        model_flags("alibi+rope", args)
