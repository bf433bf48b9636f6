"""fairseq 0.12's distributed training, made to work for CPU processes and to stop in bounded time.

- **torchrun.** fairseq reads torchrun's ``WORLD_SIZE`` and ``RANK`` only when its own world size is
  already above 1 (on CPU it is 1, so every process trained alone, all writing the same checkpoints),
  and then takes the GPU as ``rank % torch.cuda.device_count()`` (a division by zero on CPU).
  Under torchrun the world size, rank and device now come from its variables (``LOCAL_RANK`` for
  the GPU), on CPU and GPU alike.
- **CPU processes** communicate through gloo: fairseq's default ``--distributed-backend nccl`` is
  replaced by gloo when the processes have no GPU.
- **Bounded waits.** fairseq's ``--heartbeat-timeout N`` sends SIGINT after N seconds without a forward
  pass, which a process blocked in a collective never sees. Its process groups now take N seconds
  as their timeout, so a collective whose peer died or hangs fails after N seconds (torch's default
  is 30 minutes for gloo, 10 for NCCL).
- **PyTorch's DistributedDataParallel** (``--ddp-backend pytorch_ddp``, ``c10d``) was given GPU 0 as
  its device even for a model on CPU, which it refuses; on CPU it is now given no device.
- **Fully sharded data parallel** (``--ddp-backend fully_sharded``) needs fairscale and CUDA: without
  either it is refused in one line before any process starts.
- **A lost process.** A collective's report that another process died or stopped answering (gloo's
  ``Connection reset by peer``, a timeout) ends the run in one line that says how to resume
  (:func:`lost_peer_report`, registered with :mod:`kerple_fairseq.errors`), not in a traceback.

Nothing here changes fairseq when imported: :func:`install_distributed` does, called by
:func:`kerple_fairseq.fairseq_changes.apply_all`.
"""

import logging
import os
import re
from datetime import timedelta
from typing import Optional, Tuple

import torch
from fairseq.distributed import utils as distributed_utils
from fairseq.models import distributed_fairseq_model
from torch.distributed import distributed_c10d
from torch.nn.parallel import DistributedDataParallel

from kerple_fairseq.errors import KernelConfigError, first_line

logger = logging.getLogger(__name__)

TORCHRUN_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")


def torchrun_placement() -> Optional[Tuple[int, int, int]]:
    """``(world size, rank, local rank)`` when this process was started by torchrun for a world of
    more than one process, else None."""
    if not all(name in os.environ for name in TORCHRUN_VARIABLES) or int(os.environ["WORLD_SIZE"]) <= 1:
        return None
    return int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))


def uses_gpus(cfg) -> bool:
    return torch.cuda.is_available() and not cfg.common.cpu


def place_torchrun_process(cfg) -> None:
    """Take the world size, rank and device from torchrun's variables, if it started this process."""
    placement = torchrun_placement()
    training = cfg.distributed_training
    if placement is None or training.distributed_init_method is not None:
        return
    world, rank, local_rank = placement
    training.distributed_init_method = "env://"
    training.distributed_world_size = world
    training.distributed_rank = rank
    training.device_id = local_rank if uses_gpus(cfg) else 0
    training.distributed_no_spawn = True  # torchrun started every process


def check_fully_sharded(cfg) -> None:
    if cfg.distributed_training.ddp_backend != "fully_sharded":
        return
    if not uses_gpus(cfg):
        raise KernelConfigError("--ddp-backend fully_sharded runs on CUDA GPUs only (fairscale's sharding); "
                                "on CPU use --ddp-backend legacy_ddp or pytorch_ddp")
    try:
        import fairscale  # noqa: F401
    except ImportError:
        raise KernelConfigError("--ddp-backend fully_sharded needs fairscale: pip install fairscale==0.4.13 "
                                "(or use --ddp-backend legacy_ddp, the recipe's)") from None


def gloo_without_gpus(cfg) -> None:
    """fairseq's default ``--distributed-backend nccl`` becomes gloo for processes without GPUs."""
    training = cfg.distributed_training
    if not uses_gpus(cfg) and training.distributed_backend == "nccl" and training.distributed_world_size > 1:
        training.distributed_backend = "gloo"
        logger.info("processes without GPUs: --distributed-backend gloo")


def _call_main(stock):
    def call_main(cfg, main, **kwargs):
        place_torchrun_process(cfg)
        check_fully_sharded(cfg)
        gloo_without_gpus(cfg)
        return stock(cfg, main, **kwargs)

    call_main.kerple_fairseq = True
    return call_main


def bound_collective_waits(seconds: int) -> None:
    """Every process group created from now on in this process (the world's, and fairseq's own
    data-parallel groups, which do not inherit the world's) gives up a collective after ``seconds``."""
    timeout = timedelta(seconds=seconds)
    distributed_c10d.default_pg_timeout = timeout
    distributed_c10d.default_pg_nccl_timeout = timeout


def _distributed_init(stock):
    def distributed_init(cfg):
        seconds = cfg.distributed_training.heartbeat_timeout
        if seconds is not None and seconds > 0:
            bound_collective_waits(seconds)
        return stock(cfg)

    distributed_init.kerple_fairseq = True
    return distributed_init


class DeviceAwareDistributedDataParallel(DistributedDataParallel):
    """:class:`DistributedDataParallel` that ignores the GPU fairseq names for a model on CPU."""

    def __init__(self, module, device_ids=None, output_device=None, **kwargs):
        if all(p.device.type == "cpu" for p in module.parameters()):
            device_ids = output_device = None
        super().__init__(module, device_ids=device_ids, output_device=output_device, **kwargs)


# what a collective reports when another process of the run died or stopped answering (gloo, NCCL)
_LOST_PEER = re.compile(r"Connection (closed|reset) by peer|Timed out waiting|timed out|[Tt]imeout|"
                        r"NCCL communicator was aborted|Broken pipe")


def lost_peer(error: BaseException) -> Optional[str]:
    """The first line of ``error`` if it is a collective's report of a lost process."""
    distributed = isinstance(error, getattr(torch.distributed, "DistError", ())) or "gloo" in str(error) or \
        "NCCL" in str(error) or "c10d" in str(error)
    if not (distributed and _LOST_PEER.search(str(error))):
        return None
    line = re.sub(r"^\[[^\]]*\]\s*", "", first_line(error))  # gloo's [source file:line]
    return line.split(". ")[0].rstrip(".")


def lost_peer_report(error: BaseException) -> Optional[str]:
    """The one-line report of ``error`` if it is a collective's report of a lost process (a process
    killed, or blocked past ``--heartbeat-timeout``): say how to resume; registered with
    :func:`kerple_fairseq.errors.register_one_line_report` by :mod:`kerple_fairseq.fairseq_changes`."""
    lost = lost_peer(error)
    if not lost:
        return None
    return (f"another process of this training run died or stopped answering ({lost}); stopping. "
            "The same command resumes from checkpoint_last.pt in --save-dir")


def install_distributed() -> None:
    if not getattr(distributed_utils.call_main, "kerple_fairseq", False):
        distributed_utils.call_main = _call_main(distributed_utils.call_main)
    if not getattr(distributed_utils.distributed_init, "kerple_fairseq", False):
        distributed_utils.distributed_init = _distributed_init(distributed_utils.distributed_init)
    distributed_fairseq_model.DistributedDataParallel = DeviceAwareDistributedDataParallel
