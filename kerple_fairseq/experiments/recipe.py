"""How the models are trained: ALiBi's WikiText-103 recipe and its tiny CPU preset, the small CPU
runs of the comparison and the tests, and fairseq-train command lines for every GPU of a machine
(and of several machines) or for gloo processes on CPU."""

import math
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import List, NamedTuple, Optional, Sequence

from kerple_fairseq.evaluation.checkpoint_file import data_only_environment
from kerple_fairseq.experiments.language_models import model_size_flags
from kerple_fairseq.experiments.paths import BIN, USER_DIR
from kerple_fairseq.experiments.position_encodings import position_encoding


# fp16 on CPU: fairseq's fp16 optimiser with unflattened gradients (fp32 master weights, dynamic
# loss scaling); plain --fp16 with --cpu fails inside fairseq, which then asks CUDA for a device
CPU_FP16_FLAGS = ["--fp16", "--fp16-no-flatten-grads"]
# legacy_ddp: the adaptive softmax leaves some parameters without gradient in a step, which
# fairseq's c10d DDP rejects
DATA_PARALLEL = ["--ddp-backend", "legacy_ddp"]
# fairseq's --heartbeat-timeout, which the plugin also makes the process group's timeout
# (kerple_fairseq.training.distributed): a run whose process died or hangs stops within 10 minutes, as
# NCCL's own default, instead of gloo's 30; far above a step, a validation or a checkpoint write
HEARTBEAT_SECONDS = 600


class Preset(NamedTuple):
    """A recipe's fairseq-train flags (less the model's architecture, the per-run ones and the
    precision), whether its models are ALiBi's WikiText-103 architectures (``transformer_lm_*_wiki103``),
    its tokens per batch, the number of workers whose batches make one update in the recipe, and
    whether it trains in fp16."""

    flags: List[str]
    wiki103: bool
    max_tokens: int
    reference_workers: int
    fp16: bool


def adam_flags(lr: float, warmup_updates: int) -> List[str]:
    """Adam at ``lr`` after a linear warm-up of ``warmup_updates``, then inverse-square-root decay."""
    return ["--optimizer", "adam", "--lr", str(lr),
            "--lr-scheduler", "inverse_sqrt", "--warmup-updates", str(warmup_updates)]


# ALiBi's WikiText-103 recipe (the ALiBi paper's WikiText-103 setting, which KERPLE's Table 10 reuses), less the per-run options
ALIBI_WIKITEXT_103 = Preset(
    flags=["--criterion", "adaptive_loss",
           "--optimizer", "nag", "--lr", "1.0", "--clip-norm", "0.1",
           "--lr-scheduler", "cosine", "--lr-period-updates", "270000", "--t-mult", "2", "--lr-shrink", "0.75",
           "--min-lr", "0.0001", "--warmup-updates", "16000", "--warmup-init-lr", "1e-07", "--stop-min-lr", "1e-09",
           "--max-update", "286000", "--sample-break-mode", "none", "--seed", "1",
           "--skip-invalid-size-inputs-valid-test", "--required-batch-size-multiple", "1",
           "--kernel-parameterization", "clamp",  # KERPLE's reference keeps its parameters in domain by clamping
           "--heartbeat-timeout", str(HEARTBEAT_SECONDS)],
    wiki103=True,
    max_tokens=9216,
    reference_workers=8,  # the paper's 8 GPUs: 73,728 tokens per update
    fp16=True,
)
# the same pipeline on CPU in seconds: a 2-layer, 64-wide model
TINY = Preset(
    flags=[*model_size_flags(layers=2, width=64, heads=4),
           "--criterion", "cross_entropy", *adam_flags(lr=0.003, warmup_updates=5),
           "--max-update", "20", "--sample-break-mode", "none", "--seed", "1", "--num-workers", "0",
           "--heartbeat-timeout", str(HEARTBEAT_SECONDS)],
    wiki103=False,
    max_tokens=1024,
    reference_workers=2,
    # fp32, so that a resumed run equals an uninterrupted one: fairseq's fp16 checkpoints keep the
    # fp16 weights, and a resumed run rebuilds its fp32 master copy from them
    fp16=False,
)


def cpu_training_flags(tokens_per_sample: int, max_tokens: int, lr: float, warmup_updates: int, seed: int,
                       log_format: str, log_interval: int, adam_betas: Optional[str] = None,
                       clip_norm: Optional[float] = None, task: Sequence[str] = ("--task", "language_modeling"),
                       sample_break_mode: Optional[str] = "none") -> List[str]:
    """fairseq-train flags (less the model's) of a small run in one CPU process: the ``task``'s
    ``tokens_per_sample``-token samples (by default language modelling of the unbroken token stream), Adam,
    no validation, only the last checkpoint."""
    flags = [*task, "--tokens-per-sample", str(tokens_per_sample),
             *(() if sample_break_mode is None else ("--sample-break-mode", sample_break_mode)),
             "--max-tokens", str(max_tokens), *adam_flags(lr, warmup_updates),
             "--cpu", "--seed", str(seed), "--log-format", log_format, "--log-interval", str(log_interval),
             "--num-workers", "0", "--disable-validation", "--no-epoch-checkpoints"]
    if adam_betas is not None:
        flags += ["--adam-betas", adam_betas]
    if clip_norm is not None:
        flags += ["--clip-norm", str(clip_norm)]
    return flags


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def update_freq(reference_workers: int, world_size: int) -> int:
    """Batches accumulated per update so that ``world_size`` workers see the recipe's tokens per update."""
    return max(1, math.ceil(reference_workers / world_size))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_command(data: Path, model: str, train_length: int, preset: Preset, freq: int, save_dir: Path) -> List[str]:
    """fairseq-train of ``preset`` on ``data`` for ``model`` (a comparison's position encoding or a bias
    kernel, see :func:`~kerple_fairseq.experiments.position_encodings.position_encoding`), before the
    choice of devices."""
    return [str(BIN / "fairseq-train"), str(data), "--user-dir", str(USER_DIR),
            "--task", "language_modeling", *position_encoding(model).model_flags(preset.wiki103), *preset.flags,
            "--tokens-per-sample", str(train_length), "--max-tokens", str(preset.max_tokens),
            "--update-freq", str(freq), "--save-dir", str(save_dir),
            "--tensorboard-logdir", str(save_dir / "tensorboard")]


def device_flags(gpus: bool, fp16: bool) -> List[str]:
    """fp16 if asked, on GPUs or on CPU (:data:`CPU_FP16_FLAGS`)."""
    if gpus:
        return ["--fp16"] if fp16 else []
    return ["--cpu", *(CPU_FP16_FLAGS if fp16 else [])]


def cpu_commands(cmd: List[str], processes: int, fp16: bool, nodes: int = 1, node_rank: int = 0,
                 master: Optional[str] = None) -> List[List[str]]:
    """One command per gloo process of this machine, in fp16 if asked (:data:`CPU_FP16_FLAGS`): ranks
    ``node_rank * processes ...`` of ``nodes`` machines meeting at ``master`` (HOST:PORT of node 0; on
    one machine a free local port if not given). fairseq 0.12 cannot spawn CPU workers itself (it
    spawns one per GPU), so each rank is started explicitly."""
    cmd = cmd + device_flags(gpus=False, fp16=fp16)
    world = processes * nodes
    if world == 1:
        return [cmd]
    init = f"tcp://{master or f'127.0.0.1:{free_port()}'}"
    return [cmd + ["--distributed-world-size", str(world), "--distributed-rank", str(node_rank * processes + i),
                   "--distributed-init-method", init, "--distributed-no-spawn",
                   "--distributed-backend", "gloo", *DATA_PARALLEL]
            for i in range(processes)]


def gpu_command(cmd: List[str], gpus: int, nodes: int, node_rank: int, master: Optional[str], fp16: bool) -> List[str]:
    """This machine's ``gpus`` GPUs, in fp16 if asked, one of ``nodes`` machines (node 0 at ``master``, HOST:PORT);
    fairseq spawns a process per GPU."""
    cmd = cmd + device_flags(gpus=True, fp16=fp16) + [*DATA_PARALLEL, "--distributed-world-size", str(gpus * nodes)]
    if nodes > 1:
        cmd += ["--distributed-rank", str(node_rank * gpus), "--distributed-init-method", f"tcp://{master}"]
    return cmd


def torchrun_command(cmd: List[str], processes: int, nodes: int, node_rank: int, master: Optional[str],
                     gpus: bool, fp16: bool) -> List[str]:
    """torchrun starting this machine's ``processes`` (one per GPU, or gloo processes on CPU), one of
    ``nodes`` machines meeting at ``master``; fairseq reads their places from torchrun's variables
    (:mod:`kerple_fairseq.training.distributed`)."""
    host, port = master.rsplit(":", 1) if master else ("127.0.0.1", str(free_port()))
    backend = [] if gpus else ["--distributed-backend", "gloo"]
    return [str(BIN / "torchrun"), "--nnodes", str(nodes), "--nproc-per-node", str(processes),
            "--node-rank", str(node_rank), "--master-addr", host, "--master-port", port,
            *cmd, *device_flags(gpus, fp16), *backend, *DATA_PARALLEL]


def how_it_ended(status: int) -> str:
    return f"was killed by {signal.Signals(-status).name}" if status < 0 else f"exited with status {status}"


def run_all(commands: List[List[str]], first_rank: int = 0, log_dir: Optional[Path] = None,
            say=lambda message: print(message, file=sys.stderr, flush=True)) -> int:
    """Run this machine's processes, the first printing to the terminal and rank ``first_rank + i``
    to ``log_dir/rank{first_rank + i}.log``. When one fails or this launcher is told to stop
    (SIGTERM, SIGHUP), the others are stopped too (SIGTERM, then SIGKILL after
    :data:`STOP_GRACE_SECONDS`). Returns the first non-zero status, or 0."""
    logs = []
    if len(commands) > 1:
        log_dir.mkdir(parents=True, exist_ok=True)
        logs = [open(log_dir / f"rank{first_rank + i}.log", "ab") for i in range(1, len(commands))]
    procs = [subprocess.Popen(c, stdout=None if i == 0 else logs[i - 1], stderr=None if i == 0 else subprocess.STDOUT,
                              env=data_only_environment()) for i, c in enumerate(commands)]

    def stop_all(signum, frame):
        stop(procs)
        say(f"train-wikitext-103: stopped by {signal.Signals(signum).name}")
        sys.exit(128 + signum)

    previous = {s: signal.signal(s, stop_all) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        while True:
            statuses = [p.poll() for p in procs]
            failed = next((i for i, status in enumerate(statuses) if status not in (None, 0)), None)
            if failed is not None:
                where = "" if failed == 0 or log_dir is None else f" (its log: {log_dir / f'rank{first_rank + failed}.log'})"
                say(f"train-wikitext-103: the process of rank {first_rank + failed} {how_it_ended(statuses[failed])}"
                    f"{where}; stopping this machine's other processes")
                stop(procs)
                return statuses[failed] if statuses[failed] > 0 else 128 - statuses[failed]  # as a shell reports a signal
            if all(status == 0 for status in statuses):
                return 0
            time.sleep(0.2)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for log in logs:
            log.close()


STOP_GRACE_SECONDS = 10


def stop(procs: List[subprocess.Popen]) -> None:
    """SIGTERM to every running process, SIGKILL to those still running :data:`STOP_GRACE_SECONDS` later."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
