"""``scripts/gpu-check.sh``: the checks a CUDA GPU machine without network runs, in one command
(docs/gpu.md). In order, each within its time limit, a failure not stopping the next:

1. **install**: the bundle (:mod:`~kerple_fairseq.experiments.gpu_bundle`), fairseq built there against
   the machine's PyTorch, this checkout; stops everything if it refuses the bundle;
2. **cuda-tests**: ``pytest -m cuda tests``;
3. **data**: the bundle's WikiText-103 sample preprocessed (its whole vocabulary);
4. **train**: a short fp16 run of ALiBi's recipe on the 247M model, ``alibi`` and ``kerple_log`` side by
   side: losses, loss scale, overflows and kernel parameters summed up;
5. **eval**: ``kerple-eval-lm --fp16`` of both at 512 to 3072 tokens under both protocols, and their
   kernels (``kerple-analyze kernels``);
6. **speed**: KERPLE Table 4's setting, ``scripts/benchmark.py`` on the 247M model in fp16.

Everything printed also goes to ``gpu-check.log`` in the results folder, each step headed by the GPU's
name; ``gpu-check.json`` holds each step's outcome and the figures. A dry run, for a machine without
CUDA, prepares and checks the bundle, prints every command, and runs the parts that need no GPU (the
bundle's installability for the GPU machine's Python, the requirements, the test collection, the
data, the training script's own dry run).

Imports nothing of fairseq's or the plugin's: it installs them.
"""

import json
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from importlib import metadata
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Sequence

from kerple_fairseq.experiments import gpu_bundle

#: the models of the training and evaluation steps
TRAINED = ("alibi", "kerple_log")
#: fairseq-train options after ALiBi's recipe (scripts/train-wikitext-103.sh) for a short run on one
#: GPU: 9216 tokens per update (not the recipe's 8 x 9216), the warm-up shortened so that the run
#: reaches the recipe's peak learning rate, no optimizer state or per-epoch checkpoints saved, a
#: JSON log; and the sample's vocabulary (32,496 words) is below the recipe's adaptive cutoff of
#: 60,000, so the last cluster ends at 30,000
SHORT_TRAINING = ["--max-update", "200", "--update-freq", "1", "--warmup-updates", "50",
                  "--adaptive-input-cutoff", "20000,30000", "--adaptive-softmax-cutoff", "20000,30000",
                  "--no-epoch-checkpoints", "--save-interval", "1000", "--no-save-optimizer-state",
                  "--log-format", "json", "--log-interval", "10"]
#: seconds before the training step's limit at which fairseq stops itself (and saves its checkpoint)
TRAINING_STOP_MARGIN = 25
EVAL_LENGTHS = ("512", "1024", "2048", "3072")
#: KERPLE's Table 4 setting: each kernel on the 247M model against stock sinusoidal positions, fp16,
#: ALiBi's 9216 tokens per GPU
SPEED = ["--wiki103", "--fp16", "--baseline", "sinusoidal", "--models", "alibi", "kerple_log", "kerple_power", "t5",
         "--lengths", "512", "2048", "--batch-tokens", "9216", "--repeats", "7", "--memory-lengths", "8192", "16384",
         "--generate"]
#: each step's time limit in seconds (545 in all)
LIMITS = {"install": 150, "cuda-tests": 130, "data": 15, "train": 90, "eval": 60, "speed": 100}
STEPS = tuple(LIMITS)


class Step(NamedTuple):
    name: str
    what: str
    #: run side by side, by label
    commands: Dict[str, List[str]]


class Outcome(NamedTuple):
    status: str  # ok, failed, timed out, skipped, printed (dry run)
    seconds: float
    outputs: Dict[str, str]  # by label


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


def steps(paths: Paths, python: str) -> List[Step]:
    """Every step after the install, with its commands."""
    scripts = paths.repo / "scripts"
    training_stop = f"{(LIMITS['train'] - TRAINING_STOP_MARGIN) / 3600:.4f}"
    return [
        Step("cuda-tests", "every test marked cuda", {
            "pytest": [python, "-m", "pytest", "-m", "cuda", "-q", "-rfE", "-p", "no:cacheprovider",
                       "--durations=10", str(paths.repo / "tests")]}),
        Step("data", "the WikiText-103 sample, preprocessed", {
            "prepare": [python, str(scripts / "prepare_wikitext_103.py"), "--tokens-dir",
                        str(paths.bundle / gpu_bundle.SAMPLE), "--dest", str(paths.data)]}),
        Step("train", "fp16 training of the 247M model: finite, falling loss, a settled loss scale", {
            model: [python, str(scripts / "train_wikitext_103.py"), model, "--data", str(paths.data),
                    "--save-dir", str(paths.checkpoints(model)), *SHORT_TRAINING, "--stop-time-hours", training_stop]
            for model in TRAINED}),
        Step("eval", "kerple-eval-lm --fp16 at 512 to 3072, both protocols; the learned kernels", {
            **{model: [python, str(scripts / "eval_lm.py"), str(paths.data), "--path",
                       str(paths.checkpoints(model) / "checkpoint_last.pt"), "--gen-subset", "valid", "--fp16",
                       "--protocol", "all", "--lengths", *EVAL_LENGTHS, "--num-targets", "200",
                       "--results-json", str(paths.evaluation(model))] for model in TRAINED},
            "kernels": [python, str(scripts / "analyze.py"), "kernels", "--path",
                        *(str(paths.checkpoints(model) / "checkpoint_last.pt") for model in TRAINED),
                        "--labels", *TRAINED, "--out", str(paths.work / "analysis")]}),
        Step("speed", "KERPLE Table 4's setting: fp16 training steps over stock sinusoidal positions, "
             "tokens/s, evaluation memory", {
                 "benchmark": [python, str(scripts / "benchmark.py"), *SPEED, "--json", str(paths.speed)]}),
    ]


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
    """Start every command, print their lines as they come (prefixed by label when several), and stop
    those still running at ``limit_s`` (their whole process group)."""
    start = time.monotonic()
    outputs = {label: [] for label in commands}
    prefix = (lambda label: f"[{label}] ") if len(commands) > 1 else (lambda label: "")
    procs, readers = {}, []
    for label, cmd in commands.items():
        procs[label] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        errors="replace", env=env, start_new_session=True)

        def read(label=label, stream=procs[label].stdout):
            for line in stream:
                outputs[label].append(line)
                log(prefix(label) + line.rstrip("\n"))
        readers.append(threading.Thread(target=read, daemon=True))
        readers[-1].start()
    timed_out = False
    for proc in procs.values():
        try:
            proc.wait(timeout=max(0.0, limit_s - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            timed_out = True
            stop(proc)
    for reader in readers:
        reader.join(timeout=10)
    status = "timed out" if timed_out else "ok" if all(p.returncode == 0 for p in procs.values()) else "failed"
    return Outcome(status, time.monotonic() - start, {label: "".join(lines) for label, lines in outputs.items()})


def stop(proc: subprocess.Popen) -> None:
    """End ``proc`` and the processes it started (its own session): SIGTERM, then SIGKILL after 10 s."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
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
    return (f"{model}: {'sound' if summary['sound'] else 'CHECK'}: loss {losses[0]:.2f} -> {losses[-1]:.2f} (base 2) "
            f"over {summary['updates']} updates, valid loss "
            f"{' -> '.join(f'{v:.2f}' for v in summary['valid_losses']) or 'none'}, loss scale "
            f"{scales[0]:g} -> {scales[-1]:g}, {summary['overflows']} overflows" + (f"; {kernel}" if kernel else ""))


# ------------------------------------------------------------------ the command


def check(paths: Paths, dry_run: bool, only: Sequence[str] = STEPS) -> int:
    """Run (or, ``dry_run``, print and rehearse) the steps in ``only`` (the install always) with this
    Python; returns the exit status: 0 if every step ran ok, 3 if the bundle was refused, else 1."""
    python = sys.executable
    paths.results.mkdir(parents=True, exist_ok=True)
    (paths.results / "gpu-check.log").unlink(missing_ok=True)
    log = Log(paths.results / "gpu-check.log")
    gpu = gpu_name()
    if gpu is None and not dry_run:
        log("gpu-check: no CUDA GPU (nvidia-smi found none): on a machine without one, use --dry-run")
        return 1
    device = gpu or "no GPU: dry run"
    report = {"gpu": device, "dry_run": dry_run, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "steps": {}}
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "KERPLE_WIKITEXT_DIR": str(paths.bundle / gpu_bundle.SAMPLE)}
    log(f"gpu-check on {device}; results in {paths.results}, work in {paths.work}")

    def finish(status: int) -> int:
        (paths.results / "gpu-check.json").write_text(json.dumps(report, indent=1) + "\n")
        log(f"== summary ({device})")
        for name, outcome in report["steps"].items():
            log(f"{name:<11} {outcome['status']:<10} {outcome['seconds']:6.0f} s")
        return status

    log(f"== install ({device}): the bundle {paths.bundle}, then fairseq and this checkout")
    start = time.monotonic()
    try:
        installed = install(paths, dry_run, python, log)
    except gpu_bundle.BundleError as e:
        log(f"gpu-check: {e}")
        report["steps"]["install"] = {"status": "refused", "seconds": time.monotonic() - start}
        return finish(3)
    except gpu_bundle.InstallFailed as e:  # the next steps run, and say what is missing
        log(f"gpu-check: {e}")
        installed = "failed"
    report["steps"]["install"] = {"status": installed, "seconds": time.monotonic() - start}

    for step in steps(paths, python):
        if step.name not in only:
            continue
        log(f"== {step.name} ({device}): {step.what}")
        for label, cmd in step.commands.items():
            log(f"$ {shlex.join(cmd)}")
        outcome = rehearse(step, log, env) if dry_run else run_side_by_side(step.commands, LIMITS[step.name], log, env)
        report["steps"][step.name] = {"status": outcome.status, "seconds": outcome.seconds}
        if not dry_run:
            report.update(results(step, outcome, paths, log))
    return finish(0 if all(s["status"] in ("ok", "printed") for s in report["steps"].values()) else 1)


def install(paths: Paths, dry_run: bool, python: str, log) -> str:
    """The install step; returns its status. Raises :class:`~gpu_bundle.BundleError` where the bundle
    is refused, :class:`~gpu_bundle.InstallFailed` where pip fails. Afterwards (in a dry run, here)
    every requirement of fairseq-fixed and kerple-fairseq must be met; in a dry run, the bundle and
    :data:`~gpu_bundle.ON_THE_MACHINE` must cover every requirement of its packages and kerple-fairseq."""
    if dry_run:
        sample = gpu_bundle.find_sample(paths.repo)
        manifest = gpu_bundle.prepare(paths.bundle, sample, log=log, python=python)
    manifest = gpu_bundle.verify(paths.bundle)
    size = sum(f.stat().st_size for f in paths.bundle.rglob("*") if f.is_file())
    log(f"bundle: {len(manifest['packages'])} packages, the sample, {size / 2 ** 20:.1f} MiB, verified")
    unmet = []
    if dry_run:
        gpu_bundle.check_for_target(paths.bundle, manifest, python)
        log(f"pip takes every wheel for Python {gpu_bundle.TARGET_PYTHON} on manylinux x86-64")
        unmet += [f"{r} (on the GPU machine)" for r in gpu_bundle.unbundled_requirements(
            paths.bundle, manifest, metadata.requires("kerple-fairseq") or [])]
        for cmd in gpu_bundle.install_commands(paths.bundle, manifest, paths.repo, python):
            log(f"$ {shlex.join(cmd)}")
    else:
        start = time.monotonic()
        gpu_bundle.install(paths.bundle, paths.repo, python, log)
        log(f"installed in {time.monotonic() - start:.0f} s")
    unmet += gpu_bundle.unmet_requirements()
    for requirement in unmet:
        log(f"unmet requirement: {requirement}")
    return "failed" if unmet else "printed" if dry_run else "ok"


def rehearse(step: Step, log: Log, env: Dict[str, str]) -> Outcome:
    """A step's parts that need no GPU: the cuda tests collected, the data prepared, the training
    script's own dry run (its fairseq-train command lines); others printed only."""
    if step.name == "cuda-tests":
        return run_side_by_side({"collect": step.commands["pytest"] + ["--collect-only", "-q"]}, 120, log, env)
    if step.name == "data":
        return run_side_by_side(step.commands, 120, log, env)
    if step.name == "train":
        return run_side_by_side({label: cmd + ["--dry-run"] for label, cmd in step.commands.items()}, 120, log, env)
    return Outcome("printed", 0.0, {})


def results(step: Step, outcome: Outcome, paths: Paths, log: Log) -> Dict:
    """The figures a step leaves, for gpu-check.json (the training summaries also printed)."""
    if step.name == "train":
        summaries = {model: summarize_training(outcome.outputs[model]) for model in TRAINED}
        for model, summary in summaries.items():
            log(training_line(model, summary))
        return {"training": summaries}
    if step.name == "eval":
        return {"evaluation": {model: json.loads(paths.evaluation(model).read_text())
                               for model in TRAINED if paths.evaluation(model).is_file()}}
    if step.name == "speed" and paths.speed.is_file():
        return {"speed": json.loads(paths.speed.read_text())}
    return {}
