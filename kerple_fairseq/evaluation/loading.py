"""Loading a checkpoint and a split for evaluation and analysis, with one-line errors."""

import os
import re
from typing import Dict, Optional

import torch
from fairseq import checkpoint_utils, utils
from fairseq.data import data_utils
from fairseq.modules import LearnedPositionalEmbedding

from kerple_fairseq.errors import KernelConfigError, UsageError, first_line
from kerple_fairseq.evaluation.checkpoint_file import (as_fairseq_state, no_checkpoint, read_checkpoint,
                                                       unreadable_checkpoint)


#: fairseq's word for a split its data-bin lacks (``LanguageModelingTask.load_dataset``)
_MISSING_SPLIT = re.compile(r"Dataset not found: (\S+) \((.*)\)")
_SIZE_MISMATCH = re.compile(r"size mismatch for ([\w.]+): copying a param with shape (torch\.Size\(\[[\d, ]*\]\)) "
                            r"from checkpoint, the shape in current model is (torch\.Size\(\[[\d, ]*\]\))")


def not_a_data_bin(data: str) -> str:
    return (f"{data} is not a fairseq data-bin (no dict.txt): give the folder fairseq-preprocess wrote (the main "
            "job's is data-bin/wikitext-103-sample), or make one with bash scripts/prepare-wikitext-103.sh")


def check_data_bin(data: str) -> None:
    if not os.path.isfile(os.path.join(utils.split_paths(data)[0], "dict.txt")):
        raise UsageError(not_a_data_bin(data))


def dictionary_mismatch(error: BaseException) -> Optional[str]:
    """What a checkpoint loaded against another data-bin's dictionary is told, from the error of
    ``load_state_dict``, if ``error`` is such an error."""
    found = _SIZE_MISMATCH.search(str(error)) if isinstance(error, RuntimeError) else None
    if not found:
        return None
    name, saved, built = found.groups()
    return (f"the checkpoint does not fit the data-bin's dictionary ({name}: {saved} saved, {built} built from "
            "it): give the data-bin the model was trained with, or preprocess with fairseq-preprocess --srcdict "
            "<its dict.txt>")


def missing_data_report(error: BaseException) -> Optional[str]:
    """The one-line report of ``error`` if fairseq's own commands raised it for their data: a folder (or a file)
    without ``dict.txt``, a split the data-bin lacks, a checkpoint of another dictionary; registered with
    :func:`kerple_fairseq.errors.register_one_line_report` by :mod:`kerple_fairseq.fairseq_changes`."""
    if isinstance(error, (FileNotFoundError, NotADirectoryError)):  # a file's "dict.txt": NotADirectoryError
        if error.filename and os.path.basename(str(error.filename)) == "dict.txt":
            return not_a_data_bin(os.path.dirname(str(error.filename)) or ".")
        missing = _MISSING_SPLIT.search(str(error))
        if missing:
            split, path = missing.groups()
            return (f"{os.path.dirname(path) or '.'} has no '{split}' split ({split}.bin/.idx): choose one it has "
                    "(--valid-subset, --gen-subset), or preprocess that split with fairseq-preprocess")
    return dictionary_mismatch(error)


def check_checkpoint(path: str) -> None:
    """One line for a path that cannot be a checkpoint, before anything tries to read it."""
    if os.path.isdir(path):
        raise UsageError(f"checkpoint {path} is a directory; give a checkpoint file in it, e.g. "
                         f"{os.path.join(path, 'checkpoint_best.pt')}")
    if not os.path.isfile(path):
        raise UsageError(no_checkpoint(path))
    if os.path.getsize(path) == 0:
        raise UsageError(f"checkpoint {path} is an empty file")


def check_checkpoint_state(path: str, state) -> None:
    """One line for a file PyTorch reads that is not a fairseq checkpoint."""
    if not isinstance(state, dict) or "model" not in state or (state.get("cfg") is None and state.get("args") is None):
        raise UsageError(f"{path} is not a fairseq checkpoint (no model configuration in it); give a "
                         "checkpoint_*.pt file written by fairseq-train")


def load_language_model(path: str, data: Optional[str], overrides: Optional[Dict] = None, task=None,
                        attn_window: Optional[int] = None):
    """``(model, task, cfg)`` from a fairseq checkpoint (``cfg``: its configuration), the
    dictionary read from ``data`` (None: a task that reads no data-bin, given as ``task``).

    ``task``: an already set-up task (default: the checkpoint's, pointed at ``data``).
    ``attn_window``: restrict attention to the most recent keys, set on the built model
    (fairseq ignores overrides of options a checkpoint's config lacks).
    """
    if data is not None:
        check_data_bin(data)
    arg_overrides = {**({} if data is None else {"data": data}), **(overrides or {})}
    state = load_checkpoint_state(path, arg_overrides)
    try:
        models, cfg, task = checkpoint_utils.load_model_ensemble_and_task(
            [path], arg_overrides=arg_overrides, task=task, state=state)
    except KernelConfigError as e:
        raise UsageError(str(e)) from e
    except RuntimeError as e:
        raise UsageError(dictionary_mismatch(e) or f"cannot load checkpoint {path}: {first_line(e)}") from e
    except UsageError:
        raise
    except Exception as e:  # noqa: BLE001  (whatever a foreign or damaged file makes torch or fairseq raise)
        raise unreadable_checkpoint(path, e) from e
    if len(models) != 1:
        raise UsageError("give one checkpoint at a time (ensembles are not supported)")
    if attn_window is not None:
        attention_bias = getattr(models[0].decoder, "attention_bias", None)
        if attention_bias is None:
            raise UsageError(f"--attn-window needs a kerple_fairseq model; {path} is a {type(models[0]).__name__}")
        attention_bias.set_attention_window(attn_window)
    return models[0], task, cfg


def load_checkpoint_state(path: str, arg_overrides: Optional[Dict] = None) -> Dict:
    """The checkpoint's dictionary (``cfg`` with ``arg_overrides`` applied, ``model`` state), read as data
    (:func:`~kerple_fairseq.evaluation.checkpoint_file.read_checkpoint`), without building the model or a
    task; one-line errors for anything that is not a fairseq checkpoint."""
    check_checkpoint(path)
    state = read_checkpoint(path)
    check_checkpoint_state(path, state)
    try:
        return as_fairseq_state(state, arg_overrides)
    except Exception as e:  # noqa: BLE001  (whatever a configuration fairseq cannot upgrade makes it raise)
        raise unreadable_checkpoint(path, e) from e


def token_stream(task, data: str, split: str, dataset_impl=None) -> torch.Tensor:
    """The split as one stream: every line's tokens and its end-of-sentence symbol."""
    split_path = os.path.join(utils.split_paths(data)[0], split)
    dataset = data_utils.load_indexed_dataset(split_path, task.source_dictionary, dataset_impl)
    if dataset is None:
        raise UsageError(f"{data} has no '{split}' split ({split}.bin/.idx); choose another split")
    return torch.cat([dataset[i].long() for i in range(len(dataset))])


def length_limit(model):
    """The longest input the model can take, or None when nothing bounds it.

    Learned positional embeddings have a fixed table; sinusoidal ones and bias
    kernels extend to any length.
    """
    positions = getattr(model.decoder, "embed_positions", None)
    if isinstance(positions, LearnedPositionalEmbedding):
        return positions.max_positions
    return None


def rotary_embedding(model):
    """The rotary embedding of a plugin model, or None."""
    setup = getattr(model.decoder, "setup", None)
    return getattr(setup, "rotary", None)


def scale_rotary_for_length(model, length: int, train_length: int) -> None:
    """A model with rotary scaling by the evaluated length (``ntk``, ``yarn``) scaled for ``length``:
    ``s = length / train_length``; any other model is left as it is."""
    rotary = rotary_embedding(model)
    if rotary is not None and rotary.scaling != "none":
        rotary.set_scaling(rotary.scaling, train_length, length)
