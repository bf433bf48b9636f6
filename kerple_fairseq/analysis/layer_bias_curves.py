"""The curves of a per-layer bias (FIRE, FoX), drawn and measured as the kernels' are.

Each layer has its own bias, so a checkpoint gives one curve per layer and head: FIRE's row
of the query at the largest distance drawn (its rows differ by query position), FoX's mean
forget-gate decay ``d * mean(log f)`` per head and layer over the inputs of a split's first
tokens (its bias depends on them), the bias-only FoX's learned decay.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from kerple_fairseq.errors import UsageError
from kerple_fairseq.evaluation.loading import load_language_model, token_stream
from kerple_core.layer_biases import LayerBias, build_layer_bias

#: tokens of the split whose layer inputs give a content-dependent bias its mean curve
CURVE_TOKENS = 4096


@dataclass
class CheckpointLayerBiases:
    label: str
    name: str
    biases: List[LayerBias]
    inputs: Optional[List[torch.Tensor]]  # each layer's inputs, where the bias depends on them
    attention_window: int
    num_layers: int
    train_length: int

    def curves(self, max_distance: int) -> np.ndarray:
        """``[layers * heads, max_distance + 1]`` float64, layer by layer, ``-inf`` from the window on."""
        rows = []
        for layer, bias in enumerate(self.biases):
            curves = bias.curves(max_distance, self.inputs[layer] if self.inputs else None).double()
            if self.attention_window:
                curves[:, self.attention_window:] = float("-inf")
            rows.append(curves.numpy())
        return np.concatenate(rows)

    def curve_keys(self) -> List[Tuple[int, int]]:
        """``(layer, head)`` of each curve."""
        heads = self.biases[0].num_heads
        return [(layer + 1, head + 1) for layer in range(self.num_layers) for head in range(heads)]

    def description(self, max_distance: int) -> str:
        return self.biases[0].curves_description(max_distance)

    def learned_values(self) -> Dict[str, List[float]]:
        return {}

    def weight_curves(self, max_distance: int) -> None:
        return None


def load_layer_biases(path: str, label: str, state: dict, model_cfg, train_length: int,
                      data: Optional[str] = None, split: str = "valid") -> CheckpointLayerBiases:
    """Each layer's bias of a checkpoint with its trained parameters; a bias that depends on its
    inputs also needs ``data``, the data-bin whose ``split`` gives them."""
    name, layers = model_cfg.bias_kernel, int(model_cfg.decoder_layers)
    biases = []
    for layer in range(layers):
        bias = build_layer_bias(name, model_cfg.decoder_attention_heads, model_cfg.decoder_embed_dim, model_cfg)
        prefix = f"decoder.layers.{layer}.self_attn.layer_bias."
        bias.load_state_dict({k[len(prefix):]: v.float() for k, v in state["model"].items() if k.startswith(prefix)})
        biases.append(bias.eval())
    inputs = None
    if biases[0].curves_need_inputs:
        if data is None:
            raise input_dependent(f"the {name} bias", path)
        inputs = layer_inputs(path, data, split)
    return CheckpointLayerBiases(label, name, biases, inputs, int(getattr(model_cfg, "attn_window", 0) or 0),
                                 layers, train_length)


def layer_inputs(path: str, data: str, split: str) -> List[torch.Tensor]:
    """Each layer's attention inputs ``[T, 1, embed_dim]`` for the first :data:`CURVE_TOKENS` tokens of
    the split, in segments of the training length."""
    model, task, cfg = load_language_model(path, data)
    model.eval()
    stream = token_stream(task, data, split)[:CURVE_TOKENS]
    length = cfg.task.tokens_per_sample
    captured, hooks = keep_attention_inputs(model)
    run_in_segments(model, stream, length, hooks, f"the {split} split of {data}")
    return [torch.cat(pieces) for pieces in captured]


def keep_attention_inputs(model) -> Tuple[List[List[torch.Tensor]], list]:
    """Where each layer's attention inputs ``[T, batch, embed_dim]`` are kept, one list per layer, as forward
    passes of ``model`` give them; and the hooks that keep them, to remove when done."""
    captured = [[] for _ in model.decoder.layers]

    def capture(n):
        def hook(module, args, kwargs):  # fairseq's layers pass the query by keyword
            captured[n].append(kwargs["query"] if "query" in kwargs else args[0])
        return hook

    return captured, [layer.self_attn.register_forward_pre_hook(capture(n), with_kwargs=True)
                      for n, layer in enumerate(model.decoder.layers)]


def run_in_segments(model, stream: torch.Tensor, length: int, hooks, source: str) -> None:
    """Run ``model`` without gradients over each whole segment of ``length`` tokens of ``stream``
    (read from ``source``), then remove the ``hooks`` that watch it; a one-line error, and nothing
    run, where there is no whole segment."""
    try:
        if len(stream) < length:
            raise UsageError(f"{source} has fewer than {length} tokens")
        with torch.no_grad():
            for start in range(0, len(stream) - length + 1, length):
                model(stream[start:start + length][None])
    finally:
        for hook in hooks:
            hook.remove()


def input_dependent(what: str, path: str) -> UsageError:
    """The error for the curves of ``what`` (of checkpoint ``path``), which depends on the input, without data."""
    return UsageError(f"{what} of {path} depends on the input: give --data DIR (the data-bin it was trained "
                      "with) for its mean curves")
