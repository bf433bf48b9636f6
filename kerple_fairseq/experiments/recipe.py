"""How the models are trained: ALiBi's WikiText-103 recipe and its tiny CPU preset, the small CPU
runs of the comparison and the tests, and fairseq-train command lines for every GPU of a machine
(and of several machines) or for gloo processes on CPU."""

import math
import socket
import subprocess
import sys
from pathlib import Path
from typing import List, NamedTuple, Optional

from kerple_fairseq.evaluation.checkpoint_file import data_only_environment
from kerple_fairseq.experiments.language_models import model_size_flags
from kerple_fairseq.experiments.paths import BIN, USER_DIR
from kerple_fairseq.experiments.position_encodings import position_encoding


# fp16 on CPU: fairseq's fp16 optimiser with unflattened gradients (fp32 master weights, dynamic
# loss scaling); plain --fp16 with --cpu fails inside fairseq, which then asks CUDA for a device
CPU_FP16_FLAGS = ["--fp16", "--fp16-no-flatten-grads"]


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
           "--kernel-parameterization", "clamp"],  # KERPLE's reference keeps its parameters in domain by clamping
    wiki103=True,
    max_tokens=9216,
    reference_workers=8,  # the paper's 8 GPUs: 73,728 tokens per update
    fp16=True,
)
# the same pipeline on CPU in seconds: a 2-layer, 64-wide model
TINY = Preset(
    flags=[*model_size_flags(layers=2, width=64, heads=4),
           "--criterion", "cross_entropy", *adam_flags(lr=0.003, warmup_updates=5),
           "--max-update", "20", "--sample-break-mode", "none", "--seed", "1", "--num-workers", "0"],
    wiki103=False,
    max_tokens=1024,
    reference_workers=2,
    # fp32, so that a resumed run equals an uninterrupted one: fairseq's fp16 checkpoints keep the
    # fp16 weights, and a resumed run rebuilds its fp32 master copy from them
    fp16=False,
)


def cpu_training_flags(tokens_per_sample: int, max_tokens: int, lr: float, warmup_updates: int, seed: int,
                       log_format: str, log_interval: int, adam_betas: Optional[str] = None,
                       clip_norm: Optional[float] = None) -> List[str]:
    """fairseq-train flags (less the model's) of a small language-modelling run in one CPU process:
    unbroken ``tokens_per_sample``-token samples, Adam, no validation, only the last checkpoint."""
    flags = ["--task", "language_modeling", "--tokens-per-sample", str(tokens_per_sample),
             "--sample-break-mode", "none", "--max-tokens", str(max_tokens), *adam_flags(lr, warmup_updates),
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


def cpu_commands(cmd: List[str], processes: int, fp16: bool) -> List[List[str]]:
    """One command per gloo process, in fp16 if asked (:data:`CPU_FP16_FLAGS`). fairseq 0.12 cannot
    spawn CPU workers itself (it spawns one per GPU) and its torchrun inference assumes CUDA, so each
    rank is started explicitly."""
    cmd = cmd + ["--cpu"] + (CPU_FP16_FLAGS if fp16 else [])
    if processes == 1:
        return [cmd]
    init = f"tcp://127.0.0.1:{free_port()}"
    return [cmd + ["--distributed-world-size", str(processes), "--distributed-rank", str(rank),
                   "--distributed-init-method", init, "--distributed-no-spawn",
                   "--distributed-backend", "gloo", "--ddp-backend", "legacy_ddp"]
            for rank in range(processes)]


def gpu_command(cmd: List[str], gpus: int, nodes: int, node_rank: int, master: Optional[str], fp16: bool) -> List[str]:
    """This machine's ``gpus`` GPUs, in fp16 if asked, one of ``nodes`` machines (node 0 at ``master``, HOST:PORT)."""
    # legacy_ddp: the adaptive softmax leaves some parameters without gradient in a step, which
    # fairseq's c10d DDP rejects
    cmd = cmd + (["--fp16"] if fp16 else []) + ["--ddp-backend", "legacy_ddp", "--distributed-world-size", str(gpus * nodes)]
    if nodes > 1:
        cmd += ["--distributed-rank", str(node_rank * gpus), "--distributed-init-method", f"tcp://{master}"]
    return cmd


def run_all(commands: List[List[str]]) -> int:
    """Start every command; if one fails, stop the others. Returns the first non-zero status."""
    procs = [subprocess.Popen(c, stdout=None if i == 0 else subprocess.DEVNULL, stderr=None if i == 0 else subprocess.PIPE,
                              env=data_only_environment()) for i, c in enumerate(commands)]
    status = 0
    for i, p in enumerate(procs):
        code = p.wait()
        if code != 0 and status == 0:
            status = code
            if i > 0 and p.stderr is not None:
                sys.stderr.write(p.stderr.read().decode(errors="replace")[-3000:])
            for other in procs:
                if other.poll() is None:
                    other.terminate()
    return status
