"""scripts/gpu-check.sh and its bundle, without a GPU: the dry run prepares the bundle (from PyPI) and
checks it, and every command it prints is one its program accepts; installing refuses a bundle
altered or naming the machine's PyTorch or NumPy, before pip installs anything, and installs only what
an environment lacks, changing nothing it holds; a step past its time is cut, what it finished kept
(pytest's report too), the next step run, and gpu-check.json whole after every step; the training
step's summary reads fairseq's JSON log."""

import importlib.util
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from conftest import REPO, run
from gpu_tools import bundle as gpu_bundle, check as gpu_check, kernel_speed

# a fairseq-train --log-format json log of the training step's kind (a CPU fp16 run of kerple_log),
# shortened, with an overflow as fairseq logs it
TRAINING_LOG = """\
2026-11-24 23:42:10 | INFO | fairseq_cli.train | Start iterating over samples
{records}
2026-11-24 23:43:16 | INFO | fairseq.trainer | NOTE: gradient overflow detected, ignoring gradient, setting loss scale to: 64.0
2026-11-24 23:44:20 | INFO | fairseq_cli.train | Stopping training due to num_updates: 12 >= max_update: 12
2026-11-24 23:46:14 | INFO | valid | {{"epoch": 1, "valid_loss": "13.401", "valid_ppl": "10815.2", "valid_num_updates": "12"}}
2026-11-24 23:46:14 | INFO | train | {{"epoch": 1, "train_loss": "14.868", "train_num_updates": "12"}}
"""
RECORD = ('2026-11-24 23:42:31 | INFO | train_inner | {{"epoch": 1, "update": 0.008, "loss": "{loss}", '
          '"num_updates": "{updates}", "lr": "0.0012", "gnorm": "0.706", "loss_scale": "{scale}", '
          '"kernel/r1/h1": "0.5166", "kernel/r2/h1": "0.9922", "wall": "22"}}')


def training_log(losses, scales):
    records = "\n".join(RECORD.format(loss=loss, updates=2 * (i + 1), scale=scale)
                        for i, (loss, scale) in enumerate(zip(losses, scales)))
    return TRAINING_LOG.format(records=records)


def test_training_summary_reads_losses_scales_overflows_and_kernel_parameters():
    summary = gpu_check.summarize_training(training_log([15.733, 15.629, 15.267, 14.636, 14.2, 13.744],
                                                        [128, 128, 64, 64, 64, 64]))
    assert summary["updates"] == 12 and summary["losses"][-1] == 13.744 and summary["valid_losses"] == [13.401]
    assert summary["loss_scales"] == [128, 128, 64, 64, 64, 64] and summary["overflows"] == 1
    assert summary["kernel"] == {"kernel/r1/h1": 0.5166, "kernel/r2/h1": 0.9922}
    assert summary["sound"]
    line = gpu_check.training_line("kerple_log", summary)
    assert line.startswith("kerple_log: sound: loss 15.73 -> 13.74") and "1 overflows" in line and "r1/h1 0.517" in line


def test_training_summary_flags_a_flat_or_diverging_run():
    flat = gpu_check.summarize_training(training_log([15.7, 15.6, 15.7, 15.6, 15.5, 15.6], [128] * 6))
    nan = gpu_check.summarize_training(training_log([15.7, 15.2, 14.7, 14.0, 13.1, "nan"], [128] * 6))
    assert not flat["sound"] and not nan["sound"]
    assert gpu_check.training_line("alibi", nan).startswith("alibi: CHECK")
    assert gpu_check.summarize_training("fairseq-train: error: unrecognized arguments")["updates"] == 0


def pure_wheel(folder: Path, name: str, version: str) -> Path:
    """A minimal valid wheel of an empty distribution."""
    stem = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{stem}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{stem}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{stem}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                   "Tag: py3-none-any\n")
        z.writestr(f"{stem}.dist-info/RECORD", "")
    return path


def fake_bundle(bundle: Path, wheels):
    """A bundle of ``wheels`` (name, version) and an empty sample, with its manifest."""
    (bundle / "wheels").mkdir(parents=True)
    (bundle / gpu_bundle.SAMPLE).mkdir()
    packages = []
    for name, version in wheels:
        path = pure_wheel(bundle / "wheels", name, version)
        packages.append({"name": name, "version": version, "form": "wheel",
                         "file": f"wheels/{path.name}", "sha256": gpu_bundle.sha256(path)})
    sample = {}
    for name in gpu_bundle.SAMPLE_FILES:
        (bundle / gpu_bundle.SAMPLE / name).write_text("")
        sample[name] = gpu_bundle.sha256(bundle / gpu_bundle.SAMPLE / name)
    (bundle / gpu_bundle.MANIFEST).write_text(json.dumps({"packages": packages, "sample": sample}))
    return bundle


def test_installing_refuses_a_bundle_altered_or_naming_the_machines_pytorch(tmp_path):
    bundle = fake_bundle(tmp_path / "ok", [("kerple-test-pkg", "1.0")])
    manifest = gpu_bundle.verify(bundle)
    plan = gpu_bundle.pip_plan(sys.executable, ["--no-index", "--no-deps", "--ignore-installed",
                                                *gpu_bundle.files(bundle, manifest, ("wheel",))])
    assert plan == {"kerple-test-pkg": "1.0"}
    gpu_bundle.check_plan(plan, manifest, ("wheel",))

    with pytest.raises(gpu_bundle.BundleError, match="pip would install"):
        gpu_bundle.check_plan({"kerple-test-pkg": "2.0"}, manifest, ("wheel",))
    with pytest.raises(gpu_bundle.BundleError, match="refusing to install numpy, nvidia-cublas, torch"):
        gpu_bundle.check_plan({"kerple-test-pkg": "1.0", "torch": "2.13.0", "nvidia-cublas": "13", "numpy": "1.26.4"},
                              manifest, ("wheel",))

    pure_wheel(bundle / "wheels", "torch", "9.9")  # a file the manifest does not name
    with pytest.raises(gpu_bundle.BundleError, match="not in its manifest: wheels/torch-9.9-py3-none-any.whl"):
        gpu_bundle.verify(bundle)
    with pytest.raises(gpu_bundle.BundleError, match="refusing to install triton"):
        gpu_bundle.verify(fake_bundle(tmp_path / "triton", [("triton", "3.6.0")]))
    altered = fake_bundle(tmp_path / "altered", [("kerple-test-pkg", "1.0")])
    (altered / gpu_bundle.SAMPLE / "wiki.valid.tokens").write_text("changed")
    with pytest.raises(gpu_bundle.BundleError, match="differs from the one the manifest names"):
        gpu_bundle.verify(altered)
    with pytest.raises(gpu_bundle.BundleError, match="no complete bundle"):
        gpu_bundle.verify(tmp_path / "absent")


def test_gpu_check_stops_at_a_refused_bundle_before_installing_anything(tmp_path, monkeypatch):
    bundle = fake_bundle(tmp_path / "bundle", [("kerple-test-pkg", "1.0")])
    pure_wheel(bundle / "wheels", "torch", "9.9")
    monkeypatch.setattr(gpu_check, "gpu_name", lambda: "a GPU")
    ran = []
    monkeypatch.setattr(subprocess, "run", lambda args, **kwargs: ran.append(args) or
                        subprocess.CompletedProcess(args, 0, "", ""))
    paths = gpu_check.Paths(repo=REPO, bundle=bundle, results=tmp_path / "results", work=tmp_path / "work")
    assert gpu_check.check(paths, "gpu") == 3
    assert not [args for args in ran if "pip" in args], "pip ran"
    report = json.loads((tmp_path / "results" / "gpu-check.json").read_text())
    assert {name: step["status"] for name, step in report["steps"].items()} == {"preflight": "ok", "install": "refused"}
    assert report["machine"]["gpu"] == "a GPU"
    assert "not in its manifest: wheels/torch-9.9" in (tmp_path / "results" / "gpu-check.log").read_text()


@pytest.mark.slow
def test_install_adds_what_the_environment_lacks_and_changes_nothing_it_holds(tmp_path):
    """The bundle's pip 0.1 is not installed over the environment's pip; the package it lacks is."""
    run([sys.executable, "-m", "venv", tmp_path / "env"])
    python = str(tmp_path / "env" / "bin" / "python")
    pip_version = run([python, "-c", "import pip; print(pip.__version__)"]).stdout.strip()
    bundle = fake_bundle(tmp_path / "bundle", [("kerple-test-pkg", "1.0"), ("pip", "0.1")])
    plugin = pure_wheel(tmp_path, "kerple-fairseq", "0.1.0")  # in place of this checkout
    said = []
    assert gpu_bundle.install(bundle, plugin, python, said.append) == ["+ kerple-fairseq 0.1.0", "+ kerple-test-pkg 1.0"]
    assert f"kept the environment's pip {pip_version} (the bundle's: 0.1)" in said
    assert not any("--upgrade" in line for line in said)
    assert gpu_bundle.install(bundle, plugin, python, said.append) == [], "a second install changes nothing"
    assert gpu_bundle.snapshot(python)["pip"] == pip_version
    assert gpu_bundle.changed({"numpy": "2.5.2", "scipy": "1.18.1", "kerple-fairseq": "0.1.0"},
                              {"numpy": "1.26.4", "kerple-fairseq": "0.2.0"}) == ["numpy 2.5.2 -> 1.26.4",
                                                                                 "scipy 1.18.1 -> removed"]


def test_a_step_past_its_time_is_cut_its_output_kept_and_the_next_step_run(tmp_path, monkeypatch):
    """gpu-check.json, as each step begins, holds every step before it."""
    monkeypatch.setattr(gpu_check, "SHARES", {"preflight": 1, "install": 1, "cuda-tests": 3, "speed": 2, "train": 2,
                                              "eval": 1})
    monkeypatch.setattr(gpu_check, "GRACE", (5, 2))
    monkeypatch.setattr(gpu_check, "MIN_STEP_SECONDS", 0.5)
    seen = {}

    def runner(name, cmd=None):
        def run_step(paths, mode, python, limit, log, env, gpu, builder):
            seen[name] = json.loads((paths.results / "gpu-check.json").read_text())["steps"]
            if cmd is None:
                return gpu_check.Outcome("ok", 0.0, {}), {f"{name}_figures": name}
            return gpu_check.run_side_by_side({"work": cmd}, limit, log, env), {}
        return run_step

    slow = [sys.executable, "-c", "import time; print('first half done', flush=True); time.sleep(60)"]
    monkeypatch.setattr(gpu_check, "STEP_RUNNERS", {**{name: runner(name) for name in gpu_check.STEPS},
                                                    "cuda-tests": runner("cuda-tests", slow)})
    paths = gpu_check.Paths(repo=REPO, bundle=tmp_path, results=tmp_path / "results", work=tmp_path / "work")
    start = time.monotonic()
    assert gpu_check.check(paths, "gpu", budget=10) == 1
    assert time.monotonic() - start < 10 + 5
    report = json.loads((paths.results / "gpu-check.json").read_text())
    statuses = {name: step["status"] for name, step in report["steps"].items()}
    assert statuses == {"preflight": "ok", "install": "ok", "cuda-tests": "cut", "speed": "ok", "train": "ok",
                        "eval": "ok"}
    assert 3 <= report["steps"]["cuda-tests"]["seconds"] < 6 + 5
    assert report["eval_figures"] == "eval" and report["install_figures"] == "install"
    for i, name in enumerate(gpu_check.STEPS):
        assert list(seen[name]) == list(gpu_check.STEPS[:i]), name
    assert "first half done" in (paths.results / "gpu-check.log").read_text()


@pytest.mark.slow
def test_a_cut_test_run_leaves_its_report(tmp_path):
    """pytest, cut as the CUDA tier would be, still writes its JUnit XML with what it finished."""
    tests = tmp_path / "test_halves.py"
    tests.write_text("import time\n\ndef test_quick():\n    pass\n\ndef test_slow():\n    time.sleep(120)\n")
    junit = tmp_path / "report.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", str(tests)]
    outcome = gpu_check.run_side_by_side({"pytest": cmd}, 10, gpu_check.Log(tmp_path / "log"), dict(os.environ))
    assert outcome.status == "cut"
    summary = gpu_check.summarize_tests(junit)
    assert (summary["passed"], summary["failed"], summary["interrupted"]) == (1, 0, 1)


@pytest.mark.slow
def test_a_cuda_tier_longer_than_its_time_ends_itself_with_its_report(tmp_path, monkeypatch):
    """The tier's own command, its workers included, starts no test in the last SESSION_MARGIN seconds
    of its time: pytest ends by itself before the cut, its JUnit XML written (on a fresh H100 a cut
    that reached pytest-xdist tearing down its workers left no report)."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_cuda.py").write_text(
        "import time\n\nimport pytest\n\n\n@pytest.mark.cuda\n@pytest.mark.parametrize('i', range(1200))\n"
        "def test_slow(i):\n    time.sleep(1)\n")
    (tmp_path / "tests" / "test_fused_attention.py").write_text("")  # the tier's other file
    # 12 workers on a loaded 2-core machine start seconds apart, each counting its own session time
    monkeypatch.setattr(gpu_check, "SESSION_MARGIN", 30)
    paths = gpu_check.Paths(repo=tmp_path, bundle=tmp_path, results=tmp_path, work=tmp_path)
    log = gpu_check.Log(tmp_path / "log")
    start = time.monotonic()
    outcome, summary = gpu_check.cuda_tests(paths, "gpu", sys.executable, 60, log, dict(os.environ), None, None)
    assert time.monotonic() - start < 60, "pytest ended by itself, not at the cut"
    assert "--session-timeout=30" in (tmp_path / "log").read_text()
    assert (outcome.status, outcome.note) == ("cut", "no test started in its last 30 s")
    tests = summary["cuda_tests"]
    assert 0 < tests["passed"] < 1200 and tests["failed"] == tests["errors"] == 0 and "interrupted" not in tests


def printed_commands(log: str):
    """The command lines the dry run printed (``$ ...``), by program (the script's or module's name)."""
    commands = {}
    for line in log.splitlines():
        if line.startswith("$ "):
            argv = shlex.split(line[2:])
            program = argv[2] if argv[1] == "-m" else Path(argv[1]).name
            commands.setdefault(program, []).append(argv)
    return commands


def script_module(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_dry_run_prepares_the_bundle_and_prints_commands_their_programs_accept(tmp_path):
    from fairseq import options

    from kerple_fairseq.analysis.cli import build_parser as analysis_parser
    from kerple_fairseq.evaluation.cli import build_parser as eval_parser
    from kerple_fairseq.experiments.benchmark import model_flags

    bundle, results = tmp_path / "bundle", tmp_path / "results"
    proc = run(["bash", REPO / "scripts" / "gpu-check.sh", "--dry-run", "--bundle", bundle, "--results", results,
                "--work", tmp_path / "work"])
    log = (results / "gpu-check.log").read_text()
    assert log.strip() == proc.stdout.strip()
    report = json.loads((results / "gpu-check.json").read_text())
    assert report["gpu"] == "no GPU: dry-run"
    assert {name: step["status"] for name, step in report["steps"].items()} == {
        "preflight": "ok", "install": "printed", "cuda-tests": "ok", "speed": "printed", "train": "ok",
        "eval": "printed"}

    # the bundle: every pin but fairseq's wheel (built only by a builder of the GPU image's versions),
    # for the GPU machine's Python, nothing it lacks, under the transfer limit
    manifest = gpu_bundle.verify(bundle)
    assert [(p["name"], p["version"]) for p in manifest["packages"]] == [
        (p.name, p.version) for p in gpu_bundle.PINS if p.form != "built wheel"]
    assert "not building fairseq-fixed==0.12.3.1: no builder here" in log
    assert sorted(p.name for p in (bundle / "wheels").iterdir()) == sorted(
        Path(p["file"]).name for p in manifest["packages"])
    assert all("-cp312-cp312-manylinux" in p.name or p.name.endswith("-py3-none-any.whl")
               for p in (bundle / "wheels").iterdir())
    assert gpu_bundle.unbundled_requirements(bundle, manifest, metadata.requires("kerple-fairseq")) == []
    assert sum(f.stat().st_size for f in bundle.rglob("*") if f.is_file()) < 40 * 2 ** 20
    assert "pip takes every wheel for Python 3.12" in log

    commands = printed_commands(log)
    # install: from the bundle's files only, never an index, dependencies, or over what is there
    installs = commands["pip"]
    assert len(installs) == 2 and all("--no-index" in c and "--no-deps" in c and "--upgrade" not in c
                                      for c in installs)
    named = {a for c in installs for a in c if a.startswith(str(bundle))}
    assert named == {str(bundle / p["file"]) for p in manifest["packages"]}
    # cuda tests: the marker is registered, and the dry run collected the tier
    (pytest_cmd,) = commands["pytest"]
    assert pytest_cmd[pytest_cmd.index("-m", 3) + 1] == "(cuda or fused) and not cross_compile"
    assert "--collect-only" in pytest_cmd
    assert {Path(a).name for a in pytest_cmd if a.endswith(".py")} == {"test_cuda.py", "test_fused_attention.py"}
    collected = re.search(r"^(\d+)(?:/\d+)? tests collected", log, re.M)  # N/M where markers deselect some
    assert collected and int(collected.group(1)) >= 100, "the CUDA tier's collection"
    markers = run([pytest_cmd[0], "-m", "pytest", "--markers", REPO / "tests"]).stdout
    assert all(f"@pytest.mark.{marker}:" in markers for marker in ("cuda", "fused", "cross_compile"))
    # training: the script ran its own dry run; fairseq-train takes the command lines it printed
    assert [c[2] for c in commands["train_wikitext_103.py"]] == list(gpu_check.TRAINED)
    trains = {line[1:line.index("]")]: shlex.split(line.split("] ", 1)[1]) for line in log.splitlines()
              if line.startswith("[") and "fairseq-train " in line}
    assert sorted(trains) == sorted(gpu_check.TRAINED)
    for model, argv in trains.items():
        args = options.parse_args_and_arch(options.get_training_parser(), argv[1:])
        assert args.arch == f"transformer_lm_{'alibi' if model == 'alibi' else 'kerple'}_wiki103"
        assert (args.max_update, args.update_freq, args.fp16, args.save_interval_updates) == (200, [1], True, 50)
        assert args.adaptive_input_cutoff == args.adaptive_softmax_cutoff == "20000,30000"
    # evaluation and kernels: kerple-eval-lm's and kerple-analyze's parsers take them
    for argv in commands["eval_lm.py"]:
        args = options.parse_args_and_arch(eval_parser(), argv[2:])
        assert args.fp16 and args.protocol == "all" and args.lengths == [512, 1024, 2048, 3072]
    (analyze,) = commands["analyze.py"]
    assert analysis_parser().parse_args(analyze[2:]).labels == list(gpu_check.TRAINED)
    # speed: the kernel's timing at its defaults (2048 tokens); benchmark.py takes its options, and builds every
    # model it names
    (kernels,) = commands["kernel_speed.py"]
    args = kernel_speed.parse_args(kernels[2:])
    assert (args.length, args.head_dims, args.dtype) == (2048, [64, 128], "float16")
    (benchmark,) = commands["benchmark.py"]
    args = script_module("benchmark").parse_args(benchmark[2:])
    assert args.wiki103 and args.fp16 and args.baseline == "sinusoidal" and args.memory_lengths == [8192, 16384]
    for name in [args.baseline, *args.models]:
        model_flags(name, args)


def test_the_speed_step_times_the_kernel_alone_then_the_benchmark(tmp_path, monkeypatch):
    """One after the other: the kernel's timing within KERNEL_SPEED_SECONDS (cut there, what it wrote kept), then
    the benchmark in the step's time left; both JSON files among the step's figures. A rehearsal runs the
    benchmark alone."""
    paths = gpu_check.Paths(repo=REPO, bundle=tmp_path, results=tmp_path, work=tmp_path)
    cmds = gpu_check.commands("speed", paths, sys.executable, "gpu")
    assert list(cmds) == ["kernels", "benchmark"]
    assert kernel_speed.parse_args(cmds["kernels"][2:]).json == paths.kernel_speed
    assert list(gpu_check.commands("speed", paths, sys.executable, "rehearse")) == ["benchmark"]

    def writing(path, figures, sleep):
        return [sys.executable, "-c", f"import json, time; open({str(path)!r}, 'w').write(json.dumps({figures!r})); "
                f"print('wrote {path.name}', flush=True); time.sleep({sleep})"]

    monkeypatch.setattr(gpu_check, "commands", lambda *args, **kwargs: {
        "kernels": writing(paths.kernel_speed, {"head_dims": {}}, 60),
        "benchmark": writing(paths.speed, {"rows": []}, 0)})
    monkeypatch.setattr(gpu_check, "KERNEL_SPEED_SECONDS", 3)
    monkeypatch.setattr(gpu_check, "GRACE", (5, 2))
    start = time.monotonic()
    outcome, figures = gpu_check.speed(paths, "gpu", sys.executable, 30, gpu_check.Log(tmp_path / "log"),
                                       dict(os.environ), None, None)
    assert time.monotonic() - start < 25
    assert (outcome.status, outcome.note) == ("cut", "cut at its time: kernels")
    assert figures == {"kernel_speed": {"head_dims": {}}, "speed": {"rows": []}}
    lines = (tmp_path / "log").read_text().splitlines()
    started = [i for i, line in enumerate(lines) if line.startswith("$ ")]
    assert len(started) == 2 and started[0] < lines.index("wrote kernel-speed.json") < started[1]


@pytest.mark.slow
def test_the_kernel_timing_runs_on_the_cpu_under_tritons_interpreter(tmp_path):
    """The speed step's own command, at a tiny size, from another folder: a finite positive time for SDPA and for
    the fused kernel with each bias, forward and forward plus backward, and each bias's ratios to SDPA's."""
    paths = gpu_check.Paths(repo=REPO, bundle=tmp_path, results=tmp_path, work=tmp_path)
    cmd = gpu_check.commands("speed", paths, sys.executable, "gpu")["kernels"]
    run([*cmd, "--length", "64", "--head-dims", "16", "--batch", "1", "--heads", "2", "--repeats", "1"],
        cwd=tmp_path, env={**os.environ, "TRITON_INTERPRET": "1"})
    cases = json.loads(paths.kernel_speed.read_text())["head_dims"]["16"]
    assert list(cases) == ["sdpa", *kernel_speed.BIASES]
    for name, case in cases.items():
        keys = {"forward_ms", "forward_backward_ms"} | (set() if name == "sdpa" else {"forward_ratio",
                                                                                   "forward_backward_ratio"})
        assert set(case) == keys and all(math.isfinite(case[k]) and case[k] > 0 for k in keys), (name, case)


def test_a_smaller_budget_scales_every_steps_share():
    clock = gpu_check.Budget(120, ["preflight", "install", "train", "eval"])
    shares = sum(gpu_check.SHARES[s] for s in ("preflight", "install", "train", "eval"))
    assert clock.scale == pytest.approx(120 / shares)
    assert clock.limit("preflight") == pytest.approx(120 - clock.scale * (shares - gpu_check.SHARES["preflight"]), abs=1)
    assert clock.limit("eval") == pytest.approx(120, abs=1), "the last step may use what is left"
    assert gpu_check.Budget(10_000, ["preflight"]).scale == 1
