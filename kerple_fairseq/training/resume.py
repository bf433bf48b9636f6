"""What a training run leaves for its resumption: a ``checkpoint_last.pt`` that is always whole, and
a position in the epoch that holds when the run resumes on another number of processes.

- **Checkpoint copies.** fairseq writes the first checkpoint of a save to a temporary name and
  renames it, but copies it to the others (``checkpoint_last.pt``, ``checkpoint_best.pt``) in place,
  so a process killed during the copy left a truncated ``checkpoint_last.pt`` that the next start
  failed to load. Copies now go to ``NAME.tmp``, are flushed to disk, and replace ``NAME`` whole.
- **The checkpoint sent to the other processes.** On resuming, process 0 reads the checkpoint and
  sends it to the others pickled, with its configuration as an OmegaConf object and fairseq's own
  placeholder objects for its tensors; their weights-only read refused both, so a run of several
  processes could not resume. What is sent is now plain data (the configuration as a plain
  container, each placeholder as a tagged index), and the placeholders are rebuilt on arrival.
- **Data position.** fairseq records the batches each process has taken in the epoch, and every
  process takes every ``world size``-th batch of one shared order. The checkpoint now also records
  the number of processes, and a run resumed on another number starts at the same batch of that
  order (2 processes after 10 batches each = 1 process after 20), instead of repeating or skipping
  batches.
"""

import os

from fairseq import checkpoint_utils
from fairseq.data.iterators import EpochBatchIterator
from fairseq.distributed import utils as distributed_utils
from fairseq.file_io import PathManager
from omegaconf import DictConfig, ListConfig, OmegaConf

from kerple_fairseq.errors import KernelConfigError


class WholeCheckpointCopies(PathManager):
    """fairseq's :class:`PathManager` whose copies to local paths replace the destination whole."""

    @staticmethod
    def copy(src_path: str, dst_path: str, overwrite: bool = False) -> bool:
        if not PathManager.supports_rename(dst_path):
            return PathManager.copy(src_path, dst_path, overwrite=overwrite)
        partial = dst_path + ".tmp"
        PathManager.copy(src_path, partial, overwrite=True)
        with open(partial, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(partial, dst_path)
        return True


PLACEHOLDER = "__fairseq_tensor_placeholder__"


def as_data(obj):
    """``obj`` with OmegaConf containers as plain ones and fairseq's tensor placeholders as
    ``{PLACEHOLDER: index}``: what a weights-only read accepts."""
    if isinstance(obj, (DictConfig, ListConfig)):
        return OmegaConf.to_container(obj)
    if isinstance(obj, distributed_utils._TensorPlaceholder):
        return {PLACEHOLDER: obj.index}
    if isinstance(obj, dict):
        return {k: as_data(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(as_data(v) for v in obj)
    return obj


def with_placeholders(obj):
    """The inverse of :func:`as_data` for the placeholders."""
    if isinstance(obj, dict):
        if obj.keys() == {PLACEHOLDER}:
            return distributed_utils._TensorPlaceholder(index=obj[PLACEHOLDER])
        return {k: with_placeholders(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(with_placeholders(v) for v in obj)
    return obj


def _broadcast_object_slow(stock):
    def broadcast(obj, src_rank, group, dist_device):
        if distributed_utils.get_rank(group) == src_rank:
            stock(as_data(obj), src_rank, group, dist_device)
            return obj
        return with_placeholders(stock(None, src_rank, group, dist_device))

    broadcast.kerple_fairseq = True
    return broadcast


def position_for(state: dict, processes: int) -> dict:
    """``state`` (an :class:`EpochBatchIterator`'s) with its position in the epoch counted in batches
    of each of ``processes`` processes; state saved without its number of processes is unchanged."""
    saved_processes = state.get("num_shards")
    taken = state.get("iterations_in_epoch", 0)
    if not saved_processes or saved_processes == processes or not taken:
        return state
    batches = taken * saved_processes  # of the epoch's shared order, by all processes together
    if batches % processes:
        raise KernelConfigError(
            f"cannot resume on {processes} processes: the checkpoint stopped after {batches} batches of epoch "
            f"{state['epoch']} ({saved_processes} processes), which {processes} processes cannot share evenly; "
            "resume on a number of processes that divides it, or add --reset-dataloader to start the epoch over")
    return {**state, "iterations_in_epoch": batches // processes}


def _state_dict(stock):
    def state_dict(self):
        return {**stock(self), "num_shards": self.num_shards}

    state_dict.kerple_fairseq = True
    return state_dict


def _load_state_dict(stock):
    def load_state_dict(self, state_dict):
        return stock(self, position_for(state_dict, self.num_shards))

    load_state_dict.kerple_fairseq = True
    return load_state_dict


def install_resume() -> None:
    checkpoint_utils.PathManager = WholeCheckpointCopies
    if not getattr(distributed_utils._broadcast_object_slow, "kerple_fairseq", False):
        distributed_utils._broadcast_object_slow = _broadcast_object_slow(distributed_utils._broadcast_object_slow)
    if not getattr(EpochBatchIterator.state_dict, "kerple_fairseq", False):
        EpochBatchIterator.state_dict = _state_dict(EpochBatchIterator.state_dict)
        EpochBatchIterator.load_state_dict = _load_state_dict(EpochBatchIterator.load_state_dict)
