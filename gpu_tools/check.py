"""``scripts/gpu-check.sh``: what a CUDA GPU machine without network checks, in one bounded command
(docs/gpu.md). In order, each step within its share of ``--budget`` (a step that ends early leaves its
time to the next; one that overruns is cut, what it finished kept, and the next one started):

1. **preflight**: the GPU, the versions of Python, torch, NumPy and pip, a writable environment, a C
   compiler and Python's headers (Triton compiles with them);
2. **install**: what the environment lacks of the bundle (:mod:`gpu_tools.bundle`) and this checkout,
   nothing it holds changed (``pip list`` before and after), then ``import fairseq, kerple_fairseq``;
   a refusal or a failed import ends the command;
3. **cuda-tests**: ``tests/test_cuda.py`` and ``tests/test_fused_attention.py`` (the CUDA tier), a per-test
   timeout, a JUnit XML file;
4. **speed**: the fused attention kernel alone against PyTorch's flash attention at 2048 tokens
   (:mod:`gpu_tools.kernel_speed`), then KERPLE Table 4's setting, ``scripts/benchmark.py`` on the 247M model
   in fp16 (the fused kernel beside the backends before it), its profile and training memory;
5. **train**: the bundle's sample preprocessed, then a short fp16 run of ALiBi's recipe on the 247M
   model, ``alibi`` and ``kerple_log`` side by side, a checkpoint saved every 50 updates;
6. **eval**: ``kerple-eval-lm --fp16`` of both at 512 to 3072 tokens under both protocols, and their
   kernels (``kerple-analyze kernels``).

Everything printed also goes to ``gpu-check.log``; ``gpu-check.json``, rewritten whole after every
step, holds each step's outcome and figures. ``--rehearse`` runs every step on a machine without CUDA
(in an environment of the GPU image's versions), the CUDA tier skipped with its reason, the fused
kernel's timing left out, and the trainings, evaluations and benchmark at CPU size. ``--dry-run``
prepares and checks the bundle, prints every command and runs what needs neither the GPU nor the GPU
image's environment.

Imports nothing of fairseq's or the plugin's: it installs them.
"""

import json
import math
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import threading
import time
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence

from packaging.version import Version

from gpu_tools import bundle as gpu_bundle

#: the models of the training and evaluation steps
TRAINED = ("alibi", "kerple_log")
#: fairseq-train options after ALiBi's recipe (scripts/train-wikitext-103.sh) for a short run on one
#: GPU: 9216 tokens per update (not the recipe's 8 x 9216), the warm-up shortened so that the run
#: reaches the recipe's peak learning rate, a checkpoint (without optimizer state) every 50 updates
#: so that a cut run leaves one, a JSON log; the sample's vocabulary (32,496 words) is below the
#: recipe's adaptive cutoff of 60,000, so the last cluster ends at 30,000
SHORT_TRAINING = ["--max-update", "200", "--update-freq", "1", "--warmup-updates", "50",
                  "--adaptive-input-cutoff", "20000,30000", "--adaptive-softmax-cutoff", "20000,30000",
                  "--save-interval-updates", "50", "--keep-interval-updates", "1", "--no-epoch-checkpoints",
                  "--no-save-optimizer-state", "--log-format", "json", "--log-interval", "10"]
#: the rehearsal's training: the training script's CPU preset, saved as the GPU run's is
TINY_TRAINING = ["--tiny", "--max-update", "6", "--save-interval-updates", "3", "--keep-interval-updates", "1",
                 "--no-epoch-checkpoints", "--max-valid-steps", "4", "--log-format", "json", "--log-interval", "1"]
#: seconds before the training step's deadline at which fairseq stops itself (its clock starts
#: after its imports and the data's loading) and saves its checkpoint
TRAINING_STOP_MARGIN = 40
EVAL = ["--lengths", "512", "1024", "2048", "3072", "--num-targets", "200"]
TINY_EVAL = ["--lengths", "64", "128", "--num-targets", "20"]
#: KERPLE's Table 4 setting: each kernel on the 247M model against stock sinusoidal positions, fp16,
#: ALiBi's 9216 tokens per GPU; then where a step's GPU time goes at 2048. The kernels and FoX take the
#: backend chosen by default (the fused kernel); ``@flex`` keeps the backends chosen before it (SDPA in
#: training, whose attention dropout FlexAttention lacks, and FlexAttention in evaluation)
SPEED = ["--wiki103", "--fp16", "--baseline", "sinusoidal", "--models", "alibi", "kerple_log", "kerple_power", "t5",
         "fox", "alibi@flex", "kerple_log@flex", "--lengths", "512", "2048", "--batch-tokens", "9216", "--repeats", "7",
         "--memory-lengths", "8192", "16384", "--generate", "--profile", "12"]
TINY_SPEED = ["--baseline", "sinusoidal", "--models", "alibi", "kerple_log", "fox", "kerple_log@flex", "--lengths",
              "64", "--batch-tokens", "256", "--repeats", "1", "--memory-lengths", "128", "--generate", "16",
              "--max-cache-window", "8", "--profile", "3"]
#: the speed step's most seconds for the fused kernel timed alone, before the benchmark (its defaults: 2048
#: tokens, heads of 64 and 128, fp16, dropout 0.1; on an H200, mostly Triton's compiles, 30 s timed nine
#: of its ten cases)
KERNEL_SPEED_SECONDS = 45
#: the CUDA tier: the fused backend's tests (on CUDA where a GPU is), then the tests marked cuda; the fused
#: kernel's first, as the backend `auto` takes on CUDA, so that a tier cut by its share has run them
CUDA_TIER = ("test_fused_attention.py", "test_cuda.py")
#: its tests: the CUDA ones and the fused backend's, without those that compile for GPUs on a CPU
CUDA_TIER_MARKERS = "(cuda or fused) and not cross_compile"
#: each step's share of the budget in seconds (575 in all: the default --budget). On a fresh H100 the
#: CUDA tier's 244 tests before the fused backend's took about 210 s (its FlexAttention compiles cold),
#: 100 s once compiled; the speed step's 5 models 92 s, now 8, and the fused kernel timed alone (20 s, from the
#: CUDA tier's share: a second command completes the tier where it does not finish)
SHARES = {"preflight": 15, "install": 30, "cuda-tests": 225, "speed": 150, "train": 105, "eval": 50}
STEPS = tuple(SHARES)
#: variables that make cuBLAS and cuDNN (NVIDIA's) or PyTorch's cuBLAS calls use TF32 for float32,
#: whatever PyTorch's flags say: recorded by preflight, set to 0 for the CUDA tier
TF32_VARIABLES = ("NVIDIA_TF32_OVERRIDE", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE")
#: a step left less time than this is skipped
MIN_STEP_SECONDS = 5
#: seconds a cut process has to end after SIGINT (pytest then writes its report), and after SIGTERM
GRACE = (15, 5)
#: the per-test timeout of the CUDA tier, and its pytest-xdist workers where that plugin is there (the
#: tests' FlexAttention compiles are CPU work)
TEST_TIMEOUT = 90
TEST_WORKERS = 12
#: seconds before the CUDA tier's deadline after which pytest starts no test (pytest-timeout's
#: --session-timeout), so that it ends by itself with its report written: a cut that reaches
#: pytest-xdist tearing down its workers leaves none. The longest test on a fresh H100 took 32 s.
SESSION_MARGIN = 40


class Outcome(NamedTuple):
    status: str  # ok, failed, cut (past its time), skipped, printed (dry run), refused
    seconds: float
    outputs: Dict[str, str]  # by label
    note: str = ""


class Paths(NamedTuple):
    repo: Path
    bundle: Path
    results: Path
    work: Path

    @property
    def data(self) -> Path:
        return self.work / "data-bin"

    def checkpoints(self, model: str) -> Path:
        return self.work / "checkpoints" / model

    def evaluation(self, model: str) -> Path:
        return self.work / f"eval-{model}.json"

    @property
    def speed(self) -> Path:
        return self.work / "speed.json"

    @property
    def kernel_speed(self) -> Path:
        return self.work / "kernel-speed.json"

    @property
    def junit(self) -> Path:
        return self.results / "cuda-tests.xml"


class Budget:
    """The command's time: a step may run until the deadline that leaves each later step its share
    (the shares scaled down where the budget is smaller than theirs together)."""

    def __init__(self, seconds: float, steps: Sequence[str]):
        self.end = time.monotonic() + seconds
        self.steps = list(steps)
        self.scale = min(1.0, seconds / sum(SHARES[s] for s in self.steps))

    def limit(self, step: str) -> float:
        later = sum(SHARES[s] for s in self.steps[self.steps.index(step) + 1:])
        return max(0.0, self.end - self.scale * later - time.monotonic())


# ------------------------------------------------------------------ the steps' commands


def commands(step: str, paths: Paths, python: str, mode: str, limit: float = 0.0) -> Dict[str, List[str]]:
    """A step's commands, by label (run side by side). ``mode``: gpu, rehearse or dry-run."""
    scripts = paths.repo / "scripts"
    small = mode == "rehearse"
    if step == "cuda-tests":
        workers = (["-n", str(TEST_WORKERS), "--dist", "loadgroup"]
                   if gpu_bundle.installed_version("pytest-xdist") != "absent" else [])
        timeout_version = gpu_bundle.installed_version("pytest-timeout")
        timeout = [] if timeout_version == "absent" else [f"--timeout={TEST_TIMEOUT}"]
        if timeout and Version(timeout_version) >= Version("2.3"):  # its first with --session-timeout
            timeout.append(f"--session-timeout={max(limit - SESSION_MARGIN, 1):.0f}")
        # a rehearsal (no CUDA) collects the CUDA tests, skipped with their reason; it leaves out the fused
        # backend's, which would run under the interpreter of the GPU image's Triton 3.6, broken with NumPy 2.5
        # (the CPU suite runs them with the set-up's Triton)
        markers = "cuda" if small else CUDA_TIER_MARKERS
        return {"pytest": [python, "-m", "pytest", "-m", markers, "-q", "-rfEs", "-p", "no:cacheprovider",
                           *workers, "--continue-on-collection-errors", *timeout, "--durations=10",
                           f"--junitxml={paths.junit}", *(str(paths.repo / "tests" / name) for name in CUDA_TIER)]}
    if step == "speed":
        # a rehearsal leaves out the kernel timed alone, which would run under the interpreter of the GPU image's
        # Triton 3.6, broken with NumPy 2.5 (tests/test_gpu_check.py runs it under the set-up's Triton)
        kernels = {} if small else {"kernels": [python, str(paths.repo / "gpu_tools" / "kernel_speed.py"),
                                                "--json", str(paths.kernel_speed)]}
        return {**kernels, "benchmark": [python, str(scripts / "benchmark.py"), *(TINY_SPEED if small else SPEED),
                                         "--json", str(paths.speed)]}
    if step == "data":
        return {"prepare": [python, str(scripts / "prepare_wikitext_103.py"), "--tokens-dir",
                            str(paths.bundle / gpu_bundle.SAMPLE), "--dest", str(paths.data)]}
    if step == "train":
        stop = f"{max(limit - TRAINING_STOP_MARGIN, 30) / 3600:.4f}"
        return {model: [python, str(scripts / "train_wikitext_103.py"), model, "--data", str(paths.data),
                        "--save-dir", str(paths.checkpoints(model)), *(TINY_TRAINING if small else SHORT_TRAINING),
                        "--stop-time-hours", stop] for model in TRAINED}
    if step == "eval":
        checkpoints = {model: str(paths.checkpoints(model) / "checkpoint_last.pt") for model in TRAINED}
        return {**{model: [python, str(scripts / "eval_lm.py"), str(paths.data), "--path", checkpoints[model],
                           "--gen-subset", "valid", *([] if small else ["--fp16"]), "--protocol", "all",
                           *(TINY_EVAL if small else EVAL), "--results-json", str(paths.evaluation(model))]
                   for model in TRAINED},
                "kernels": [python, str(scripts / "analyze.py"), "kernels", "--path", *checkpoints.values(),
                            "--labels", *TRAINED, "--out", str(paths.work / "analysis")]}
    raise ValueError(step)


# ------------------------------------------------------------------ running


class Log:
    """Prints to stdout and appends to the results folder's log."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "a", encoding="utf-8")
        self.lock = threading.Lock()

    def __call__(self, text: str = "") -> None:
        with self.lock:
            print(text, flush=True)
            self.file.write(text + "\n")
            self.file.flush()


def run_side_by_side(commands: Dict[str, List[str]], limit_s: float, log: Log, env: Dict[str, str]) -> Outcome:
    """Start every command, print their lines as they come (prefixed by label when several), and cut
    those still running at ``limit_s`` (:func:`stop`); what they printed is kept."""
    start = time.monotonic()
    outputs = {label: [] for label in commands}
    prefix = (lambda label: f"[{label}] ") if len(commands) > 1 else (lambda label: "")
    procs, readers = {}, []
    for label, cmd in commands.items():
        log(f"$ {shlex.join(cmd)}")
        # SIGINT back to its default in the step: a check started in the background (nohup ... &) passes
        # its commands an ignored SIGINT, and pytest would then never write its report when cut
        procs[label] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        errors="replace", env=env, start_new_session=True,
                                        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))

        def read(label=label, stream=procs[label].stdout):
            for line in stream:
                outputs[label].append(line)
                log(prefix(label) + line.rstrip("\n"))
        readers.append(threading.Thread(target=read, daemon=True))
        readers[-1].start()
    cut = False
    for proc in procs.values():
        try:
            proc.wait(timeout=max(0.0, limit_s - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            cut = True
            stop(proc)
    for reader in readers:
        reader.join(timeout=10)
    status = "cut" if cut else "ok" if all(p.returncode == 0 for p in procs.values()) else "failed"
    return Outcome(status, time.monotonic() - start, {label: "".join(lines) for label, lines in outputs.items()})


def stop(proc: subprocess.Popen) -> None:
    """End ``proc`` and the processes it started (its own session): SIGINT (pytest writes its report,
    Python programs unwind), then SIGTERM, then SIGKILL."""
    for sig, wait in ((signal.SIGINT, GRACE[0]), (signal.SIGTERM, GRACE[1]), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def gpu_name() -> Optional[str]:
    """``NVIDIA H100 80GB HBM3 (driver 580.159.04, 81559 MiB)`` from nvidia-smi; None without a GPU."""
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0 or not proc.stdout.strip():
        return None
    name, driver, memory = (part.strip() for part in proc.stdout.strip().splitlines()[0].split(","))
    return f"{name} (driver {driver}, {memory})"


# ------------------------------------------------------------------ summaries


def summarize_training(log: str) -> Dict:
    """From a fairseq-train JSON log: the logged training losses (base 2), validation losses, loss
    scales, gradient overflows and last kernel parameters, and whether the run looks sound: every
    value finite, the mean of the last three logged losses at least 0.5 below the first three's, and
    at most one update in ten skipped for overflow."""
    lines = log.splitlines()
    records = [json.loads(line[line.index("{"):]) for line in lines if "| train_inner |" in line]
    valid = [float(json.loads(line[line.index("{"):])["valid_loss"]) for line in lines if "| valid |" in line]
    losses = [float(r["loss"]) for r in records]
    updates = int(records[-1]["num_updates"]) if records else 0
    overflows = sum("gradient overflow detected" in line for line in lines)
    kernel = {k: float(v) for k, v in records[-1].items() if k.startswith("kernel/")} if records else {}
    finite = all(math.isfinite(x) for x in losses + valid + list(kernel.values()))
    falling = len(losses) >= 6 and statistics.mean(losses[-3:]) < statistics.mean(losses[:3]) - 0.5
    return {"updates": updates, "losses": losses, "valid_losses": valid,
            "loss_scales": [float(r["loss_scale"]) for r in records if "loss_scale" in r],
            "overflows": overflows, "kernel": kernel,
            "sound": finite and falling and overflows <= max(1, updates // 10)}


def training_line(model: str, summary: Dict) -> str:
    losses, scales = summary["losses"], summary["loss_scales"]
    if not losses:
        return f"{model}: no training loss logged"
    kernel = ", ".join(f"{k.split('/', 1)[1]} {v:.3g}" for k, v in summary["kernel"].items())
    scale = f"loss scale {scales[0]:g} -> {scales[-1]:g}, " if scales else ""
    return (f"{model}: {'sound' if summary['sound'] else 'CHECK'}: loss {losses[0]:.2f} -> {losses[-1]:.2f} (base 2) "
            f"over {summary['updates']} updates, valid loss "
            f"{' -> '.join(f'{v:.2f}' for v in summary['valid_losses']) or 'none'}, {scale}"
            f"{summary['overflows']} overflows" + (f"; {kernel}" if kernel else ""))


def summarize_tests(junit: Path) -> Dict:
    """Counts of a pytest JUnit XML file, and the failures' and errors' names with their first line."""
    if not junit.is_file():
        return {"report": "none written"}
    root = ET.parse(junit).getroot()
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    problems, skips = [], {}
    for case in root.iter("testcase"):
        if case.get("name") is None:  # the test running when pytest was interrupted
            counts["interrupted"] = counts.get("interrupted", 0) + 1
            continue
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        if outcome is None:
            counts["passed"] += 1
        elif outcome.tag == "skipped":
            counts["skipped"] += 1
            reason = outcome.get("message", "")
            skips[reason] = skips.get(reason, 0) + 1
        else:
            counts["failed" if outcome.tag == "failure" else "errors"] += 1
            message = (outcome.get("message") or "").splitlines()
            problems.append(f"{name}: {message[0][:300] if message else ''}")
    return {**counts, "problems": problems, "skip_reasons": skips}


# ------------------------------------------------------------------ the command


class Report:
    """gpu-check.json, rewritten whole after every step."""

    def __init__(self, path: Path, **fields):
        self.path, self.data = path, {**fields, "steps": {}}
        self.write()

    def step(self, name: str, outcome: Outcome, **figures) -> None:
        self.data["steps"][name] = {"status": outcome.status, "seconds": round(outcome.seconds, 1),
                                    **({"note": outcome.note} if outcome.note else {})}
        self.data.update(figures)
        self.write()

    def write(self) -> None:
        partial = self.path.with_suffix(".json.partial")
        partial.write_text(json.dumps(self.data, indent=1) + "\n")
        partial.rename(self.path)


def check(paths: Paths, mode: str = "gpu", only: Sequence[str] = STEPS, budget: float = sum(SHARES.values()),
          builder: Optional[str] = None) -> int:
    """Run the steps of ``only`` (preflight and install always) in ``mode`` (gpu, rehearse, dry-run)
    with this Python; returns the exit status: 0 if every step ran ok, 3 if the bundle was refused or
    the command could not go on after preflight or install, else 1."""
    python = sys.executable
    paths.results.mkdir(parents=True, exist_ok=True)
    for old in (paths.results / "gpu-check.log", paths.junit, paths.speed, paths.kernel_speed,
                *map(paths.evaluation, TRAINED)):
        old.unlink(missing_ok=True)  # an earlier run's figures are never taken for this one's
    shutil.rmtree(paths.work / "checkpoints", ignore_errors=True)
    paths.work.mkdir(parents=True, exist_ok=True)
    log = Log(paths.results / "gpu-check.log")
    gpu = gpu_name()
    device = gpu or f"no GPU: {mode}"
    selected = [s for s in STEPS if s in ("preflight", "install") or s in only]
    clock = Budget(budget, selected)
    report = Report(paths.results / "gpu-check.json", gpu=device, mode=mode, budget_s=budget,
                    started=time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "KERPLE_WIKITEXT_DIR": str(paths.bundle / gpu_bundle.SAMPLE)}
    log(f"gpu-check ({mode}) on {device}: steps {', '.join(selected)} within {budget:.0f} s; "
        f"results in {paths.results}, work in {paths.work}")
    status = 0
    for name in selected:
        limit = clock.limit(name)
        log(f"== {name} ({device}): within {limit:.0f} s")
        start = time.monotonic()
        if limit < MIN_STEP_SECONDS:
            outcome, figures = Outcome("skipped", 0.0, {}, "no time left in the budget"), {}
        else:
            outcome, figures = STEP_RUNNERS[name](paths, mode, python, limit, log, env, gpu, builder)
        outcome = outcome._replace(seconds=time.monotonic() - start)
        log(f"-- {name}: {outcome.status} in {outcome.seconds:.0f} s" + (f" ({outcome.note})" if outcome.note else ""))
        report.step(name, outcome, **figures)
        if outcome.status not in ("ok", "printed", "skipped"):
            status = 1
        if name in ("preflight", "install") and outcome.status in ("failed", "refused"):
            log(f"gpu-check: stopping after {name}: {outcome.note}")
            status = 3
            break
    log(f"== summary ({device})")
    for name, step in report.data["steps"].items():
        log(f"{name:<11} {step['status']:<8} {step['seconds']:6.0f} s  {step.get('note', '')}")
    return status


StepRunner = Callable[..., tuple]


def preflight(paths, mode, python, limit, log, env, gpu, builder):
    """The machine, before anything is installed; fails without a GPU where one is needed, or where
    the environment is not writable."""
    facts = {"python": platform.python_version(), "gpu": gpu}
    for name in ("torch", "numpy", "scipy", "triton", "pip", "setuptools", "pytest", "pytest-timeout"):
        facts[name] = gpu_bundle.installed_version(name)
    purelib = sysconfig.get_paths()["purelib"]
    facts["site-packages"] = purelib
    facts["writable"] = os.access(purelib, os.W_OK)
    facts["compiler"] = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    facts["python_headers"] = (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file()
    probe = subprocess.run([python, "-c", "import torch; print(torch.cuda.is_available() and "
                            "torch.cuda.get_device_name(0), torch.version.cuda, 'tf32: matmul', "
                            "torch.backends.cuda.matmul.allow_tf32, 'cudnn', torch.backends.cudnn.allow_tf32, "
                            "'precision', torch.get_float32_matmul_precision())"], capture_output=True, text=True)
    facts["torch_cuda"] = probe.stdout.strip() or probe.stderr.strip()[-300:]
    for name in TF32_VARIABLES:
        facts[name] = os.environ.get(name)
    for key, value in facts.items():
        log(f"{key}: {value}")
    problems = []
    if mode == "gpu" and gpu is None:
        problems.append("no CUDA GPU (nvidia-smi found none): on a machine without one, use --rehearse or --dry-run")
    if mode != "dry-run" and not facts["writable"]:
        problems.append(f"{purelib} is not writable")
    if not (facts["compiler"] and facts["python_headers"]):
        log("warning: no C compiler or no Python.h: Triton (FlexAttention, torch.compile) cannot build its launchers")
    if mode != "dry-run" and facts["pytest-timeout"] == "absent":
        log("warning: pytest-timeout absent: the CUDA tier runs without a per-test timeout")
    status = "failed" if problems else "ok"
    return Outcome(status, 0.0, {}, "; ".join(problems)), {"machine": facts}


def install(paths, mode, python, limit, log, env, gpu, builder):
    """The bundle (prepared first in a rehearsal or dry run), then the import of fairseq and the plugin."""
    try:
        if mode != "gpu":
            gpu_bundle.prepare(paths.bundle, gpu_bundle.find_sample(paths.repo), builder, log=log,
                               build=mode == "rehearse" or builder is not None)
        manifest = gpu_bundle.verify(paths.bundle)
        size = sum(f.stat().st_size for f in paths.bundle.rglob("*") if f.is_file())
        log(f"bundle: {len(manifest['packages'])} packages, the sample, {size / 2 ** 20:.1f} MiB, verified")
        if mode == "dry-run":
            return dry_install(paths, manifest, python, log)
        difference = gpu_bundle.install(paths.bundle, paths.repo, python, log)
    except gpu_bundle.BundleError as e:
        log(f"gpu-check: {e}")
        return Outcome("refused", 0.0, {}, str(e)), {}
    except gpu_bundle.InstallFailed as e:
        log(f"gpu-check: {e}")
        return Outcome("failed", 0.0, {}, str(e).splitlines()[0]), {}
    unmet = gpu_bundle.unmet_requirements()
    for requirement in unmet:
        log(f"unmet requirement: {requirement}")
    smoke = subprocess.run([python, "-c", "import fairseq, kerple_fairseq, numpy, torch; print('imported fairseq', "
                            "fairseq.__version__, 'with numpy', numpy.__version__, 'torch', torch.__version__)"],
                           capture_output=True, text=True, env=env, cwd="/")
    log((smoke.stdout + smoke.stderr).strip()[-2000:])
    if smoke.returncode != 0:
        return Outcome("failed", 0.0, {}, "import fairseq, kerple_fairseq failed"), {"installed": difference}
    return Outcome("failed" if unmet else "ok", 0.0, {}, "; ".join(unmet)), {"installed": difference}


def dry_install(paths, manifest, python, log):
    gpu_bundle.check_for_target(paths.bundle, manifest, python)
    log(f"pip takes every wheel for Python {gpu_bundle.TARGET_PYTHON} on manylinux x86-64")
    unmet = [f"{r} (on the GPU machine)" for r in gpu_bundle.unbundled_requirements(
        paths.bundle, manifest, metadata.requires("kerple-fairseq") or [])]
    unmet += gpu_bundle.unmet_requirements()
    for cmd in gpu_bundle.install_commands(paths.bundle, manifest["packages"], paths.repo, python):
        log(f"$ {shlex.join(cmd)}")
    for requirement in unmet:
        log(f"unmet requirement: {requirement}")
    return Outcome("failed" if unmet else "printed", 0.0, {}, "; ".join(unmet)), {}


def cuda_tests(paths, mode, python, limit, log, env, gpu, builder):
    """The CUDA tier, float32 products in IEEE precision whatever the image's settings (its fixture
    turns PyTorch's TF32 off; these variables turn off the libraries' own overrides)."""
    cmds = commands("cuda-tests", paths, python, mode, limit)
    if mode == "dry-run":
        cmds = {"collect": cmds["pytest"] + ["--collect-only"]}
    outcome = run_side_by_side(cmds, limit, log, {**env, **{name: "0" for name in TF32_VARIABLES}})
    if "session-timeout:" in outcome.outputs.get("pytest", ""):
        outcome = outcome._replace(status="cut", note=f"no test started in its last {SESSION_MARGIN} s")
    tests = summarize_tests(paths.junit) if mode != "dry-run" else {}
    if tests:
        log(f"cuda tier: {json.dumps({k: v for k, v in tests.items() if k != 'problems'})}")
        if mode == "rehearse" and tests.get("passed", 0) + tests.get("failed", 0) + tests.get("errors", 0) == 0:
            outcome = outcome._replace(note="every CUDA test skipped: no GPU here")
    return outcome, {"cuda_tests": tests}


def speed(paths, mode, python, limit, log, env, gpu, builder):
    """The fused kernel timed alone (within :data:`KERNEL_SPEED_SECONDS`), then the benchmark in the step's
    time left, one after the other so that neither times the GPU while the other uses it."""
    cmds = commands("speed", paths, python, mode)
    if mode == "dry-run":
        return printed(cmds, log), {}
    for path in (paths.kernel_speed, paths.speed):
        path.unlink(missing_ok=True)
    start = time.monotonic()
    outcomes = []
    for label, cmd in cmds.items():
        left = limit - (time.monotonic() - start)
        outcomes.append(run_side_by_side({label: cmd}, min(left, KERNEL_SPEED_SECONDS) if label == "kernels" else left,
                                         log, env))
    statuses = {outcome.status for outcome in outcomes}
    status = "cut" if "cut" in statuses else "failed" if "failed" in statuses else "ok"
    cut = [label for label, outcome in zip(cmds, outcomes) if outcome.status == "cut"]
    outcome = Outcome(status, time.monotonic() - start, {k: v for o in outcomes for k, v in o.outputs.items()},
                      f"cut at its time: {', '.join(cut)}" if cut else "")
    figures = {key: json.loads(path.read_text()) for key, path in (("kernel_speed", paths.kernel_speed),
                                                                   ("speed", paths.speed)) if path.is_file()}
    return outcome, figures


def train(paths, mode, python, limit, log, env, gpu, builder):
    """The sample preprocessed (its own time within the step's), then both trainings side by side."""
    start = time.monotonic()
    data = run_side_by_side(commands("data", paths, python, mode), limit, log, env)
    if data.status != "ok":
        return data._replace(note="the sample's preprocessing " + data.status), {}
    cmds = commands("train", paths, python, mode, limit - (time.monotonic() - start))
    if mode == "dry-run":  # the training script's own dry run: its fairseq-train command lines
        cmds = {label: cmd + ["--dry-run"] for label, cmd in cmds.items()}
        return run_side_by_side(cmds, limit, log, env), {}
    outcome = run_side_by_side(cmds, limit - (time.monotonic() - start), log, env)
    summaries = {model: summarize_training(outcome.outputs[model]) for model in TRAINED}
    for model, summary in summaries.items():
        log(training_line(model, summary))
    saved = {model: (paths.checkpoints(model) / "checkpoint_last.pt").is_file() for model in TRAINED}
    log(f"checkpoints saved: {saved}")
    if outcome.status == "cut" and all(saved.values()):
        outcome = outcome._replace(note="cut at its time, each model's last checkpoint saved")
    return outcome, {"training": summaries, "checkpoints_saved": saved}


def evaluate(paths, mode, python, limit, log, env, gpu, builder):
    cmds = commands("eval", paths, python, mode)
    if mode == "dry-run":
        return printed(cmds, log), {}
    absent = [m for m in TRAINED if not (paths.checkpoints(m) / "checkpoint_last.pt").is_file()]
    if absent:
        return Outcome("skipped", 0.0, {}, f"no checkpoint of {', '.join(absent)}"), {}
    outcome = run_side_by_side(cmds, limit, log, env)
    return outcome, {"evaluation": {model: json.loads(paths.evaluation(model).read_text())
                                    for model in TRAINED if paths.evaluation(model).is_file()}}


def printed(cmds: Dict[str, List[str]], log: Log) -> Outcome:
    for cmd in cmds.values():
        log(f"$ {shlex.join(cmd)}")
    return Outcome("printed", 0.0, {})


STEP_RUNNERS: Dict[str, StepRunner] = {"preflight": preflight, "install": install, "cuda-tests": cuda_tests,
                                       "speed": speed, "train": train, "eval": evaluate}
