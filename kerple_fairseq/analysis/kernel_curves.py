"""A checkpoint's bias curves ``B_h(d)`` (KERPLE §5.4) and effective lengths (KERPLE A.5).

The effective length of head ``h`` is the smallest distance ``d`` with ``B_h(d) < -2``:
a bias of -2 scales a key's softmax weight by ``exp(-2) ~ 0.135``, so the head mostly
ignores keys farther than that. Counting the heads whose effective length is ``<= x``
for every ``x`` gives KERPLE's Figure 6b.
"""

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from kerple_fairseq.errors import KernelConfigError, UsageError
from kerple_fairseq.evaluation.loading import load_checkpoint_state
from kerple_core.kernels import BiasKernel, build_kernel
from kerple_core.attention.distance_bias import DistanceBias
from kerple_core.attention.methods import chosen_methods, layout
from kerple_fairseq.analysis.cope_curves import CheckpointContextualPositions
from kerple_fairseq.analysis.layer_bias_curves import input_dependent, load_layer_biases
from kerple_core.layer_biases import LAYER_BIASES
from kerple_core.visibility import VISIBILITY_RULES, Visibility

KERNEL_PREFIX = "decoder.attention_bias.kernel."
EFFECTIVE_LENGTH_THRESHOLD = -2.0


@dataclass
class CheckpointKernel:
    label: str
    kernel: BiasKernel
    attention_window: int  # 0: none
    num_layers: int
    train_length: int
    #: learned per-head values of the attention methods (scalable softmax's ``s_h`` of each layer), by name
    other_values: Dict[str, List[float]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.kernel.name

    def curve_keys(self) -> List[Tuple[str, int]]:
        """``(layer, head)`` of each curve: the kernel is every layer's ("")."""
        return [("", head + 1) for head in range(self.kernel.num_heads)]

    def description(self, max_distance: int) -> str:
        return ""

    def curves(self, max_distance: int) -> np.ndarray:
        """``[heads, max_distance + 1]`` float64 copy of the float32 ``B_h(d)``, ``-inf`` from the window on."""
        with torch.no_grad():
            return DistanceBias(self.kernel, Visibility(window=self.attention_window)).per_distance(max_distance + 1).double().numpy()

    def learned_values(self) -> Dict[str, List[float]]:
        """Each learnable parameter's effective per-head values (as the forward uses them), by name;
        empty for a kernel without constrained parameters."""
        values = getattr(self.kernel, "values", None)
        with torch.no_grad():
            kernel = {} if values is None else {name: v.double().tolist() for name, v in values().items()}
        return {**kernel, **self.other_values}

    def weight_curves(self, max_distance: int) -> Optional[np.ndarray]:
        """``W_h(d)`` of a weight kernel, else None."""
        if not self.kernel.has_weight:
            return None
        with torch.no_grad():
            return DistanceBias(self.kernel, Visibility(window=self.attention_window)).weight_per_distance(max_distance + 1).double().numpy()


def load_kernel(path: str, label: str, data: Optional[str] = None, split: str = "valid"):
    """The kernel of a kerple_fairseq checkpoint with its trained parameters (a
    :class:`CheckpointKernel`), or its layers' biases
    (:class:`~kerple_fairseq.analysis.layer_bias_curves.CheckpointLayerBiases`), with CoPE's mean term
    where it has one (:class:`~kerple_fairseq.analysis.cope_curves.CheckpointContextualPositions`);
    only what depends on the input needs ``data``, the data-bin whose ``split`` gives it."""
    state = load_checkpoint_state(path)
    cfg = state.get("cfg")
    model_cfg = cfg["model"] if cfg is not None else None
    name = getattr(model_cfg, "bias_kernel", None) if model_cfg is not None else None
    if name is None:
        arch = getattr(model_cfg, "_name", None) or getattr(model_cfg, "arch", "unknown")
        raise UsageError(f"{path} is not a kerple_fairseq checkpoint (architecture {arch}); kernel analyses "
                         "need a model trained with --user-dir kerple_fairseq")
    plan = getattr(model_cfg, "layer_positions", "")
    if plan:
        raise UsageError(f"{path} gives each layer its own position encoding (--layer-positions {plan}); the kernel "
                         "analyses read a model-wide one, so they do not draw it")
    train_length = int(cfg["task"].tokens_per_sample)
    if name in VISIBILITY_RULES:  # only which keys a query sees: the kernel under it is none
        name = "none"
    if name in LAYER_BIASES:
        under = load_layer_biases(path, label, state, model_cfg, train_length, data, split)
    else:
        under = _checkpoint_kernel(path, label, state, name, model_cfg, train_length)
    if not getattr(model_cfg, "cope", False):
        return under
    if data is None:
        raise input_dependent("the CoPE term", path)
    return CheckpointContextualPositions(label, under, path, data, split, int(model_cfg.decoder_layers),
                                         int(model_cfg.decoder_attention_heads))


def _checkpoint_kernel(path: str, label: str, state: dict, name: str, model_cfg, train_length: int) -> CheckpointKernel:
    try:
        kernel = build_kernel(name, model_cfg.decoder_attention_heads, model_cfg)
        weights = {k[len(KERNEL_PREFIX):]: v.float() if v.is_floating_point() else v
                   for k, v in state["model"].items() if k.startswith(KERNEL_PREFIX)}
        kernel.load_state_dict(weights)
    except (KernelConfigError, RuntimeError) as e:
        raise UsageError(f"cannot rebuild the {name} kernel of {path}: {str(e).splitlines()[0]}") from e
    return CheckpointKernel(label, kernel.eval(), int(getattr(model_cfg, "attn_window", 0) or 0),
                            int(model_cfg.decoder_layers), train_length, method_values(state["model"], model_cfg))


def method_values(model_state: dict, model_cfg) -> Dict[str, List[float]]:
    """The learned per-head values each attention method of the model reports, per layer
    (``ssmax_s/layer1``, ...), from a model's state dict."""
    methods = chosen_methods(model_cfg)
    places = layout(methods)
    values = {}
    for layer in range(int(model_cfg.decoder_layers)):
        for method in methods:
            prefix = f"decoder.layers.{layer}.self_attn.{places[method.name]}."
            for name, value in method.learned_values(model_state, prefix).items():
                values[f"{name}/layer{layer + 1}"] = value.double().tolist()
    return values


def effective_lengths(curves: np.ndarray, threshold: float = EFFECTIVE_LENGTH_THRESHOLD) -> List[Optional[int]]:
    """Per head, the smallest distance with ``B_h(d) < threshold``; None if no distance in the curve has one."""
    below = curves < threshold
    return [int(np.argmax(row)) if row.any() else None for row in below]


def heads_within(lengths: Sequence[Optional[int]], xs: np.ndarray) -> np.ndarray:
    """For each ``x``: how many heads have an effective length ``<= x``."""
    known = np.array([n for n in lengths if n is not None], dtype=np.int64)
    return (known[None, :] <= np.asarray(xs)[:, None]).sum(axis=1)
