"""Reading a checkpoint file as data, never as code.

A fairseq checkpoint is a pickle; unpickling an arbitrary one can call any Python function it names
(``os.system`` among them). Every checkpoint the plugin reads goes through :func:`read_checkpoint`:
PyTorch's weights-only unpickler, asked for explicitly (so no ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``
in the environment turns it off), which rebuilds tensors and plain Python values and nothing else,
plus :data:`CHECKPOINT_GLOBALS`, the few harmless types that older checkpoints hold: the
``argparse.Namespace`` of fairseq's ``args`` (ALiBi's fork, fairseq before Hydra) and NumPy scalars in
their logged metrics. A file that names anything else is refused before any of it is built.
"""

import argparse
import contextlib
import os
import pickle
import re
from typing import Dict, Optional

import numpy as np
import torch
from fairseq import checkpoint_utils
from fairseq.dataclass.utils import overwrite_args_by_name
from omegaconf import OmegaConf, open_dict

from kerple_fairseq.errors import UsageError, first_line
from kerple_fairseq.models.config import saved_before

try:
    from numpy._core.multiarray import scalar as _numpy_scalar  # NumPy 2
except ImportError:
    from numpy.core.multiarray import scalar as _numpy_scalar  # NumPy 1
# the harmless types besides tensors and plain values, with the names older NumPy pickled them under
CHECKPOINT_GLOBALS = [
    argparse.Namespace,  # fairseq's `args` before its Hydra configuration (ALiBi's fork: fairseq 0.10)
    np.dtype,
    *[type(np.dtype(t)) for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                                  np.uint32, np.uint64, np.float16, np.float32, np.float64)],  # its classes
    # a NumPy scalar (its dtype and its bytes), under the names NumPy 1 and 2 pickle it with
    (_numpy_scalar, "numpy.core.multiarray.scalar"),
    (_numpy_scalar, "numpy._core.multiarray.scalar"),
]
# fairseq-train and the evaluators started by the plugin's scripts read checkpoints weights-only even
# where fairseq's own torch.load call leaves the choice to PyTorch's default or to the environment
DATA_ONLY_ENVIRONMENT = {"TORCH_FORCE_WEIGHTS_ONLY_LOAD": "1"}
_REFUSED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)|got <class '([\w.]+)'>")
_SEE_DOCS = "docs/fairseq-tools.md, 'Checkpoints are read as data'"


def allow_checkpoint_globals() -> None:
    """Let every weights-only load in this process (fairseq's own, in fairseq-eval-lm, fairseq-train's
    --restore-file, the hub interface) rebuild :data:`CHECKPOINT_GLOBALS` too."""
    torch.serialization.add_safe_globals(CHECKPOINT_GLOBALS)


def data_only_environment() -> Dict[str, str]:
    """This process's environment with every ``torch.load`` forced to the weights-only unpickler, for
    the fairseq commands the plugin's scripts start."""
    env = {k: v for k, v in os.environ.items() if k != "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"}
    return {**env, **DATA_ONLY_ENVIRONMENT}


def refused_object(error: BaseException) -> Optional[str]:
    """The Python object a weights-only load refused to build, if ``error`` is such a refusal."""
    named = _REFUSED_GLOBAL.search(str(error)) if isinstance(error, pickle.UnpicklingError) else None
    return (named.group(1) or named.group(2)) if named else None


def refusal(named: str) -> str:
    """Why a file that asks for the Python object ``named`` is not read, and what to do."""
    return (f"it asks for the Python object {named}, which is neither a tensor nor a plain value, and reading it "
            f"could run code; nothing was run. Give a checkpoint written by fairseq-train, or convert one you "
            f"trust ({_SEE_DOCS})")


def refused_checkpoint_report(error: BaseException) -> Optional[str]:
    """The one-line report of ``error`` if it is a weights-only load's refusal of a checkpoint (by
    fairseq's own load: ``--restore-file``, ``checkpoint_last.pt``); registered with
    :func:`kerple_fairseq.errors.register_one_line_report` by :mod:`kerple_fairseq.fairseq_changes`."""
    named = refused_object(error)
    return f"refused to read a checkpoint: {refusal(named)}" if named else None


def no_checkpoint(path: str) -> str:
    return (f"checkpoint {path} does not exist; give a checkpoint_*.pt file written by fairseq-train (the main "
            "job's: runs/small-comparison/<model>-seed1/checkpoint_last.pt)")


def reading_error(path: str, error: BaseException) -> UsageError:
    """The one-line error of a checkpoint file that torch could not read, or refused to."""
    named = refused_object(error)
    if named:
        return UsageError(f"refused to read checkpoint {path}: {refusal(named)}")
    said = first_line(error).split(". ")[0]  # torch goes on with advice about corrupted files
    return UsageError(f"cannot read checkpoint {path}: not a PyTorch file, or a damaged or truncated one "
                      f"({said}); give a checkpoint_*.pt file written by fairseq-train")


def unreadable_checkpoint(path: str, error: BaseException) -> UsageError:
    """The one-line error of a checkpoint read whole that fairseq cannot make a model of."""
    return UsageError(f"cannot read checkpoint {path} ({type(error).__name__}: {first_line(error)}); "
                      "give a checkpoint_*.pt file written by fairseq-train")


def read_checkpoint(path: str):
    """What ``path`` holds, rebuilt from tensors, plain values and :data:`CHECKPOINT_GLOBALS` only;
    a one-line :class:`UsageError` for a file that needs anything else or is not a PyTorch file."""
    try:
        with torch.serialization.safe_globals(CHECKPOINT_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001  (whatever a foreign or damaged file makes torch raise)
        raise reading_error(path, error) from error


_MISSING_MODEL = re.compile(r"Model file not found: (.*)")


def missing_checkpoint_report(error: BaseException) -> Optional[str]:
    """The one-line report of fairseq's own refusal of a checkpoint path that does not exist
    (``fairseq-eval-lm``, ``fairseq-interactive``, ``fairseq-generate``, the hub interface); registered
    with :func:`kerple_fairseq.errors.register_one_line_report` by :mod:`kerple_fairseq.fairseq_changes`."""
    found = _MISSING_MODEL.match(str(error)) if isinstance(error, OSError) else None
    return no_checkpoint(found.group(1)) if found else None


def with_saved_behaviour(state: Dict, arg_overrides: Optional[Dict] = None) -> Dict:
    """``state`` (a plugin checkpoint's, read by fairseq or as data) with each option added since it was
    saved (:func:`~kerple_fairseq.models.config.saved_before`) set to the value that keeps the behaviour it
    was trained with, or to ``arg_overrides``' value for it: fairseq would otherwise give it the option's
    new default (and drop an override of a key the configuration lacks)."""
    overrides = arg_overrides or {}
    model = state.get("cfg", {}).get("model") if state.get("cfg") is not None else None
    if model is not None and "bias_kernel" in model:
        with open_dict(model) if OmegaConf.is_config(model) else contextlib.nullcontext():
            for name, value in saved_before().items():
                if name not in model:
                    model[name] = overrides.get(name, value)
    args = state.get("args")
    if args is not None and hasattr(args, "bias_kernel"):
        for name, value in saved_before().items():
            if not hasattr(args, name):
                setattr(args, name, overrides.get(name, value))
    return state


def _naming_the_file(stock):
    def load_checkpoint_to_cpu(path, arg_overrides=None, load_on_all_ranks=False):
        try:
            state = stock(path, arg_overrides, load_on_all_ranks)
        except Exception as error:  # noqa: BLE001  (whatever a foreign or damaged file makes torch raise)
            raise reading_error(path, error) from error
        return with_saved_behaviour(state, arg_overrides)

    load_checkpoint_to_cpu.kerple_fairseq = True
    return load_checkpoint_to_cpu


def install_checkpoint_reading_errors() -> None:
    """fairseq's own reads of a checkpoint file (every stock command, ``--restore-file``, the hub
    interface) fail with the one-line error of :func:`reading_error`, which names the file, and keep the
    behaviour a plugin checkpoint was saved with (:func:`with_saved_behaviour`)."""
    if not getattr(checkpoint_utils.load_checkpoint_to_cpu, "kerple_fairseq", False):
        checkpoint_utils.load_checkpoint_to_cpu = _naming_the_file(checkpoint_utils.load_checkpoint_to_cpu)


def as_fairseq_state(state: Dict, arg_overrides: Optional[Dict] = None) -> Dict:
    """``state`` as fairseq's ``load_checkpoint_to_cpu`` returns a file's: ``arg_overrides`` applied to
    its ``args`` or ``cfg``, ``cfg`` an OmegaConf config, older layouts upgraded (``args`` to ``cfg``), the
    behaviour it was saved with kept (:func:`with_saved_behaviour`)."""
    state = with_saved_behaviour(state)
    if state.get("args") is not None and arg_overrides is not None:
        for name, value in arg_overrides.items():
            setattr(state["args"], name, value)
    if state.get("cfg") is not None:
        state["cfg"] = OmegaConf.create(state["cfg"], flags={"allow_objects": True})
        if arg_overrides is not None:
            overwrite_args_by_name(state["cfg"], arg_overrides)
    return checkpoint_utils._upgrade_state_dict(state)
