"""Loading a checkpoint and a split for evaluation and analysis, with one-line errors."""

import os
import pickle
from typing import Dict, Optional

import torch
from fairseq import checkpoint_utils, utils
from fairseq.data import Dictionary, data_utils
from fairseq.modules import LearnedPositionalEmbedding

from kerple_fairseq.errors import KernelConfigError, UsageError


def _unreadable(path: str, error: BaseException) -> UsageError:
    detail = str(error).splitlines()[0] if str(error) else "truncated file"
    return UsageError(f"cannot read checkpoint {path} ({type(error).__name__}: {detail}); "
                      "is it a complete fairseq checkpoint?")


# what torch.load and fairseq's upgrade code raise on a damaged or foreign file
UNREADABLE = (EOFError, OSError, ValueError, KeyError, AttributeError, pickle.UnpicklingError)


def check_data_bin(data: str) -> None:
    if not os.path.isfile(os.path.join(utils.split_paths(data)[0], "dict.txt")):
        raise UsageError(f"{data} is not a fairseq data-bin (no dict.txt); run fairseq-preprocess --only-source first")


def dictionary_size(data: str) -> int:
    return len(Dictionary.load(os.path.join(utils.split_paths(data)[0], "dict.txt")))


def check_checkpoint(path: str) -> None:
    if not os.path.isfile(path):
        raise UsageError(f"checkpoint {path} does not exist")


def load_language_model(path: str, data: str, overrides: Optional[Dict] = None, task=None,
                        attn_window: Optional[int] = None):
    """``(model, task, cfg)`` from a fairseq checkpoint (``cfg``: its configuration), the
    dictionary read from ``data``.

    ``task``: an already set-up task (default: the checkpoint's, pointed at ``data``).
    ``attn_window``: restrict attention to the most recent keys, set on the built model
    (fairseq ignores overrides of options a checkpoint's config lacks).
    """
    check_data_bin(data)
    check_checkpoint(path)
    try:
        models, cfg, task = checkpoint_utils.load_model_ensemble_and_task(
            [path], arg_overrides={"data": data, **(overrides or {})}, task=task)
    except KernelConfigError as e:
        raise UsageError(str(e)) from e
    except RuntimeError as e:
        if "size mismatch" in str(e):
            raise UsageError(
                f"the dictionary of {data} ({dictionary_size(data)} types) does not "
                "match the checkpoint's: use the data-bin the model was trained with, or preprocess with "
                "fairseq-preprocess --srcdict <its dict.txt>") from e
        raise UsageError(f"cannot load checkpoint {path}: {str(e).splitlines()[0]}") from e
    except UNREADABLE as e:
        raise _unreadable(path, e) from e
    if len(models) != 1:
        raise UsageError("give one checkpoint at a time (ensembles are not supported)")
    if attn_window is not None:
        attention_bias = getattr(models[0].decoder, "attention_bias", None)
        if attention_bias is None:
            raise UsageError(f"--attn-window needs a kerple_fairseq model; {path} is a {type(models[0]).__name__}")
        attention_bias.set_attention_window(attn_window)
    return models[0], task, cfg


def load_checkpoint_state(path: str) -> Dict:
    """The checkpoint's dictionary (``cfg``, ``model`` state), without building the model or a task."""
    check_checkpoint(path)
    try:
        return checkpoint_utils.load_checkpoint_to_cpu(path)
    except UNREADABLE + (RuntimeError,) as e:
        raise _unreadable(path, e) from e


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
