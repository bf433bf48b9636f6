"""scripts/train-wikitext-103.sh: gloo data parallelism, exact resume, TensorBoard kernel parameters,
and the GPU command line (built here, run where a GPU is)."""

import sys

import numpy as np
import pytest
import torch

from kerple_fairseq.experiments import recipe

from conftest import REPO, run

SCRIPT = REPO / "scripts" / "train_wikitext_103.py"
sys.path.insert(0, str(REPO / "scripts"))

import train_wikitext_103 as T  # noqa: E402

UPDATES = 4


def train(data_bin, save_dir, *flags, check=True):
    return run([sys.executable, SCRIPT, "kerple_log", "--tiny", "--data", data_bin, "--save-dir", save_dir,
                "--max-update", str(UPDATES), "--dropout", "0", "--log-format", "json", "--log-interval", "1",
                "--disable-validation", *flags], check=check)


def parameters(save_dir):
    return torch.load(save_dir / "checkpoint_last.pt", map_location="cpu", weights_only=True)["model"]


def assert_same_parameters(a, b, atol):
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=atol, msg=key)


@pytest.fixture(scope="module")
def one_process(data_bin, tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("one-process")
    proc = train(data_bin, save_dir, "--cpu-processes", "1")
    assert "1 CPU worker(s), --update-freq 2: 2048 tokens per update" in proc.stderr
    return save_dir


@pytest.mark.slow
def test_two_gloo_processes_equal_one_process_with_update_freq_2(data_bin, tmp_path, one_process):
    proc = train(data_bin, tmp_path, "--cpu-processes", "2")
    assert "2 CPU worker(s), --update-freq 1: 2048 tokens per update" in proc.stderr
    assert "distributed init (rank 1)" in proc.stdout + proc.stderr or (tmp_path / "checkpoint_last.pt").is_file()
    assert_same_parameters(parameters(tmp_path), parameters(one_process), atol=1e-6)


@pytest.mark.slow
def test_interrupted_and_resumed_run_equals_the_uninterrupted_one(data_bin, tmp_path, one_process):
    train(data_bin, tmp_path, "--cpu-processes", "1", "--max-update", str(UPDATES // 2))
    halfway = parameters(tmp_path)
    train(data_bin, tmp_path, "--cpu-processes", "1")  # resumes from checkpoint_last.pt
    assert_same_parameters(parameters(tmp_path), parameters(one_process), atol=1e-6)
    # the updates after the interruption did change the parameters (so the equalities above are not trivial)
    key = "decoder.attention_bias.kernel.r1"
    assert (halfway[key] - parameters(tmp_path)[key]).abs().max() > 1e-4


@pytest.mark.slow
def test_kernel_parameters_per_head_in_tensorboard(one_process):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(one_process / "tensorboard" / "train_inner"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    expected = {f"kernel/{p}/h{h}" for p in ("r1", "r2") for h in range(1, 5)}
    assert expected <= tags, sorted(tags)
    for tag in expected:
        values = [e.value for e in events.Scalars(tag)]
        # effective values, the floor included (TensorBoard holds float32: 0.01 is 0.0099999998)
        assert len(values) == UPDATES and all(v >= np.float32(0.01) for v in values)


def test_update_freq_keeps_the_recipes_tokens_per_update():
    assert [recipe.update_freq(8, n) for n in (1, 2, 4, 8, 16)] == [8, 4, 2, 1, 1]
    assert recipe.update_freq(8, 3) == 3  # 9 batches of 9216: the closest from above; the script says so


def test_gpu_command_is_the_fp16_multi_gpu_recipe(monkeypatch, capsys, tmp_path):
    (tmp_path / "dict.txt").write_text("a 1\n")
    launched = []
    monkeypatch.setattr(recipe, "gpu_count", lambda: 4)
    monkeypatch.setattr(recipe, "run_all", lambda commands, **where: launched.extend(commands) or 0)
    with pytest.raises(SystemExit) as exit_info:
        T.main(["alibi", "--data", str(tmp_path), "--save-dir", str(tmp_path / "ckpt"),
                "--nodes", "2", "--node-rank", "1", "--master", "node0:29500", "--max-update", "10"])
    assert exit_info.value.code == 0 and len(launched) == 1
    cmd = " ".join(launched[0])
    for part in ["--arch transformer_lm_alibi_wiki103", "--fp16", "--ddp-backend legacy_ddp",
                 "--max-tokens 9216", "--update-freq 1", "--distributed-world-size 8", "--distributed-rank 4",
                 "--distributed-init-method tcp://node0:29500", "--tokens-per-sample 512", "--optimizer nag",
                 "--lr-scheduler cosine", "--tensorboard-logdir", "--kernel-parameterization clamp"]:
        assert part in cmd, part
    assert cmd.endswith("--max-update 10")  # passed through, after (so overriding) the recipe's 286000
    assert "8 GPU worker(s), --update-freq 1: 73728 tokens per update" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("model, flags, message", [
    ("alibi", ["--data", "/nonexistent"], "is not a data-bin (no dict.txt); run: bash scripts/prepare-wikitext-103.sh"),
    ("alibi", ["--nodes", "2"], "--nodes > 1 needs --master HOST:PORT"),
    ("alibi", ["--train-length", "-5"], "argument --train-length: must be a positive integer, got -5"),
    ("alibi", ["--nodes", "0"], "argument --nodes: must be a positive integer, got 0"),
    ("alibi_v2", [], "unknown model 'alibi_v2': choose a position encoding (sinusoidal, rotary, nope, t5, alibi, "
                     "kerple_log, fire, fox, dape_alibi, dape_kerple_log, rotary_ntk, rotary_dynamic_ntk, rotary_yarn, "
                     "xpos, cope, stick_breaking, selective, ssmax, rotary_rerope, rotary_leaky_rerope, "
                     "rotary_rerope_unscaled, p_rope, bam_ssmax, bam_ssmax_queries, bam, rnope_swa, swan, irope, "
                     "gemma, path) or a position "
                     "method (bias kernels: alibi, alibi_rf, "),
])
def test_bad_input_is_one_line(data_bin, model, flags, message):
    args = [sys.executable, SCRIPT, model, "--tiny"] + (["--data", str(data_bin)] if "--data" not in flags else []) + flags
    proc = run(args, check=False)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [f"train-wikitext-103: error: {proc.stderr.split('error: ', 1)[1].strip()}"]
    assert message in proc.stderr


@pytest.mark.slow
def test_dry_run_prints_the_command_lines(data_bin, tmp_path):
    proc = run([sys.executable, SCRIPT, "alibi", "--tiny", "--data", data_bin, "--save-dir", tmp_path / "x",
                "--cpu-processes", "2", "--dry-run"])
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 2 and all("fairseq-train" in line for line in lines)
    assert "--distributed-rank 0" in lines[0] and "--distributed-rank 1" in lines[1]
    assert not any("--fp16" in line for line in lines)  # the smoke preset trains in fp32, resuming exactly
    # the full recipe's fp16, in the combination fairseq runs on CPU
    proc = run([sys.executable, SCRIPT, "alibi", "--data", data_bin, "--save-dir", tmp_path / "x",
                "--cpu-processes", "2", "--dry-run"])
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 2 and all("--cpu --fp16 --fp16-no-flatten-grads" in line for line in lines)
    assert not (tmp_path / "x").exists()
