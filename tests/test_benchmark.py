"""scripts/benchmark.py --quick: every model, length and phase timed against `none` in one run,
and memory measured per model (the figures themselves are for the README, not asserted); model names
(KERNEL+TRANSFORM@BACKEND, the --wiki103 architectures), the adaptive softmax's training loss, and the
backend each model ran on with FlexAttention's compiles."""

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


def tiny_args(**overrides):
    """The benchmark's options for 1-layer models of width 32 over 50 words."""
    import argparse

    args = dict(layers=1, width=32, heads=4, lengths=[128], memory_lengths=[], model_args=[], vocab=50,
                wiki103=False, fp16=False)
    return argparse.Namespace(**{**args, **overrides})


def test_models_name_a_kernel_and_optionally_a_method_over_it():
    from kerple_fairseq.experiments.benchmark import build, model_flags

    args = tiny_args()
    flags = model_flags("alibi+dape", args)
    assert flags[:6] == ["--arch", "transformer_lm_kerple", "--bias-kernel", "alibi", "--dape", "mlp"]
    assert model_flags("fire+dape-conv", args)[3:6] == ["fire", "--dape", "conv"]
    assert "--dape" not in model_flags("fox", args)
    assert model_flags("none+cope", args)[3:5] == ["none", "--cope"]
    assert model_flags("alibi+stick-breaking", args)[3:5] == ["alibi", "--stick-breaking"]
    rerope = build("none+rotary-leaky-rerope", args, "cpu").decoder.setup.rotary
    assert rerope.scaling == "leaky-rerope" and rerope.rerope_window_size() == 128
    model = build("kerple_log+dape-conv", args, "cpu")
    assert model.decoder.layers[0].self_attn.score_transform is not None
    with pytest.raises(ValueError, match="unknown model 'alibi\\+rope'"):
        model_flags("alibi+rope", args)


def test_model_at_backend_names_its_attention_backend():
    from kerple_fairseq.experiments.benchmark import model_flags

    args = tiny_args()
    flags = model_flags("alibi@flex", args)
    assert flags[:4] == ["--arch", "transformer_lm_kerple", "--bias-kernel", "alibi"]
    assert flags[flags.index("--attention-backend") + 1] == "flex"
    assert model_flags("kerple_log+dape@explicit", args)[3:8] == ["kerple_log", "--dape", "mlp", "--attention-backend",
                                                                   "explicit"]
    assert "--attention-backend" not in model_flags("alibi", args)
    with pytest.raises(ValueError, match="unknown attention backend @fast"):
        model_flags("alibi@fast", args)
    with pytest.raises(ValueError, match="stock fairseq"):
        model_flags("none@flex", args)


def test_model_options_of_its_own_time_a_model_against_itself_changed():
    """``/OPTION=VALUE`` after a model's name: that model alone built with ``--OPTION VALUE``."""
    from kerple_fairseq.experiments.benchmark import build, model_flags

    args = tiny_args()
    flags = model_flags("alibi+dape@explicit/cpu-attention-block-scores=0/attention-block-size=64", args)
    assert flags[3:12] == ["alibi", "--dape", "mlp", "--attention-backend", "explicit", "--cpu-attention-block-scores",
                           "0", "--attention-block-size", "64"]
    assert "--cpu-attention-block-scores" not in model_flags("alibi+dape@explicit", args)
    import torch

    setup = build("alibi/cpu-attention-block-scores=4096", args, torch.device("cpu")).decoder.setup
    assert setup.cpu_block_scores == 4096
    with pytest.raises(ValueError, match="must be /OPTION=VALUE"):
        model_flags("alibi/cpu-attention-block-scores", args)
    with pytest.raises(ValueError, match="stock fairseq"):
        model_flags("sinusoidal/dropout=0", args)


def test_wiki103_models_are_alibis_wikitext_103_architectures():
    from kerple_fairseq.experiments.benchmark import model_flags

    args = tiny_args(wiki103=True)
    assert model_flags("sinusoidal", args)[:2] == ["--arch", "transformer_lm_wiki103"]
    assert model_flags("none", args)[:3] == ["--arch", "transformer_lm_wiki103", "--no-token-positional-embeddings"]
    flags = model_flags("t5@sdpa", args)
    assert flags[:4] == ["--arch", "transformer_lm_kerple_wiki103", "--bias-kernel", "t5"]
    assert "--decoder-layers" not in flags, "the architecture's own size"


def test_training_loss_through_the_adaptive_softmax_is_fairseqs_adaptive_loss():
    import torch
    from fairseq.criterions.adaptive_loss import AdaptiveLoss

    from kerple_fairseq.experiments.benchmark import build, training_loss
    from kerple_fairseq.experiments.language_models import DictionaryTask

    args = tiny_args(model_args=["--adaptive-softmax-cutoff", "20,40", "--dropout", "0"])
    model = build("kerple_log", args, torch.device("cpu"))
    assert model.decoder.adaptive_softmax is not None
    # adaptive_loss ignores a tail cluster's target equal to the padding index (1): words 21 and 41 here
    words = torch.tensor([w for w in range(4, 54) if w not in (21, 41)])
    tokens = words[torch.randint(len(words), (2, 32))]
    sample = {"net_input": {"src_tokens": tokens}, "target": tokens, "ntokens": tokens.numel()}
    expected, _, _ = AdaptiveLoss(DictionaryTask(50), sentence_avg=False)(model, sample)
    assert training_loss(model, tokens).item() == pytest.approx(expected.item(), rel=1e-5)


@pytest.mark.slow
def test_models_at_flex_and_sdpa_report_the_backend_that_ran_and_flex_compiles(tmp_path):
    out = tmp_path / "bench.json"
    proc = run([sys.executable, REPO / "scripts" / "benchmark.py", "--models", "alibi@flex", "alibi@sdpa",
                "--lengths", "128", "--phases", "eval", "--repeats", "1", "--memory-lengths", "--generate",
                "--layers", "1", "--width", "32", "--heads", "2", "--vocab", "100", "--cpu", "--json", out])
    results = json.loads(out.read_text())
    rows = {r["model"]: r for r in results["timing"]}
    assert list(rows) == ["none", "alibi@flex", "alibi@sdpa"] and {r["phase"] for r in rows.values()} == {"eval"}
    assert rows["alibi@flex"]["backends"] == {"flex": 1} and rows["alibi@sdpa"]["backends"] == {"sdpa": 1}
    assert rows["none"]["backends"] == {}
    assert "alibi@flex" in proc.stdout and "[flex]" in proc.stdout and "[fairseq]" in proc.stdout
    compiles = results["flex_compiles"]
    assert compiles["count"] >= 1 and compiles["seconds"] > 0
    assert f"FlexAttention: {compiles['count']} compiles" in proc.stdout


def test_profile_lists_each_steps_costliest_operations_with_their_shares(capsys):
    import torch

    from kerple_fairseq.experiments.benchmark import build, profile_all

    args = tiny_args(phases=["train", "eval"], lengths=[64, 96], batch_tokens=192, profile=1000)
    cpu = torch.device("cpu")
    models = {name: build(name, args, cpu) for name in ("alibi@sdpa", "alibi@explicit")}
    rows = profile_all(models, args, cpu)
    for phase in args.phases:
        for name in models:
            own = [r for r in rows if (r["phase"], r["model"]) == (phase, name)]
            assert own and {r["length"] for r in own} == {96}, "the longest length"
            shares = [r["share"] for r in own]
            assert shares == sorted(shares, reverse=True) and sum(shares) == pytest.approx(1.0)
            assert all(r["calls"] >= 1 and r["ms"] >= 0 for r in own)
            names = " ".join(r["name"] for r in own)
            assert ("scaled_dot_product" in names) == name.endswith("@sdpa"), (phase, name)
            assert ("backward" in names.lower()) == (phase == "train"), (phase, name)
    args.profile = 2
    assert len(profile_all(models, args, cpu)) == 2 * 2 * 2
    assert "profile train L=96 alibi@sdpa:" in capsys.readouterr().out


def test_the_hosts_view_of_each_step(capsys):
    """When the call returns and when the step ends, at the longest length, for each phase and model; on a CPU the
    host does the work, so nothing is said of synchronisation (tests/test_cuda.py checks it on a GPU)."""
    import torch

    from kerple_fairseq.experiments.benchmark import build, host_view

    args = tiny_args(phases=["train", "eval"], lengths=[64, 96], batch_tokens=192, profile=1)
    cpu = torch.device("cpu")
    models = {name: build(name, args, cpu) for name in ("alibi@sdpa", "kerple_log")}
    rows = host_view(models, args, cpu)
    assert [(r["phase"], r["model"], r["length"]) for r in rows] == [
        (phase, name, 96) for phase in ("train", "eval") for name in models]
    assert all(0 < r["returned_ms"] <= r["ended_ms"] and r["synchronising"] is None for r in rows), rows
    assert "host train L=96 kerple_log: the call returns after" in capsys.readouterr().out


@pytest.mark.parametrize("option, value, message", [
    ("--lengths", "0", "--lengths must be token counts >= 1, got [0]"),
    ("--memory-lengths", "-5", "--memory-lengths must be token counts >= 1, got [-5]"),
    ("--batch-tokens", "0", "--batch-tokens must be >= 1, got 0"),
    ("--repeats", "0", "--repeats must be >= 1, got 0")])
def test_a_length_or_count_below_one_is_refused_in_one_line(tmp_path, option, value, message):
    proc = run([sys.executable, REPO / "scripts" / "benchmark.py", option, value, "--cpu", "--json",
                tmp_path / "bench.json"], check=False)
    assert proc.returncode == 2 and not (tmp_path / "bench.json").exists()
    assert proc.stderr.strip().splitlines()[-1].startswith(f"benchmark.py: error: {message} ")
    assert "Traceback" not in proc.stderr


def test_a_negative_profile_is_refused_in_one_line(tmp_path):
    proc = run([sys.executable, REPO / "scripts" / "benchmark.py", "--profile", "-3", "--cpu", "--json",
                tmp_path / "bench.json"], check=False)
    assert proc.returncode == 2 and not (tmp_path / "bench.json").exists()
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "benchmark.py: error: --profile must be >= 0 (kernels listed per step; 0: no profile), got -3")
    assert "Traceback" not in proc.stderr

