"""The curves of CoPE, drawn and measured as the kernels' are.

CoPE's term ``q_i . e(p_ij)`` depends on the content, so a checkpoint gives one curve per layer
and head: the bias under it (its distance kernel's ``B_h(d)``, or its layer's bias) plus the
term's mean over every query and key ``d`` apart in a split's first tokens, relative to its
mean at ``d = 0`` (softmax ignores a row's constant).
"""

from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import numpy as np
import torch

from kerple_fairseq.analysis.layer_bias_curves import CURVE_TOKENS, run_in_segments
from kerple_fairseq.evaluation.loading import load_language_model, token_stream


@dataclass
class CheckpointContextualPositions:
    label: str
    under: object  # the curves of the bias under CoPE (a CheckpointKernel or CheckpointLayerBiases)
    path: str
    data: str
    split: str
    num_layers: int
    num_heads: int
    measured: Dict[int, np.ndarray] = field(default_factory=dict)  # mean terms by max_distance

    @property
    def name(self) -> str:
        return self.under.name

    @property
    def attention_window(self) -> int:
        return self.under.attention_window

    @property
    def train_length(self) -> int:
        return self.under.train_length

    def curves(self, max_distance: int) -> np.ndarray:
        """``[layers * heads, max_distance + 1]`` float64, layer by layer, ``-inf`` from the window on."""
        if max_distance not in self.measured:
            self.measured[max_distance] = mean_terms_by_distance(self.path, self.data, self.split, max_distance)
        terms = self.measured[max_distance]
        terms = terms - terms[:, :, :1]
        under = self.under.curves(max_distance).reshape(-1, self.num_heads, max_distance + 1)
        return (under + terms).reshape(-1, max_distance + 1)

    def curve_keys(self) -> List[Tuple[int, int]]:
        """``(layer, head)`` of each curve."""
        return [(layer + 1, head + 1) for layer in range(self.num_layers) for head in range(self.num_heads)]

    def description(self, max_distance: int) -> str:
        return ", ".join(filter(None, [self.under.description(max_distance), "with CoPE's mean term"]))

    def learned_values(self) -> Dict[str, List[float]]:
        return self.under.learned_values()

    def weight_curves(self, max_distance: int) -> None:
        return None


def mean_terms_by_distance(path: str, data: str, split: str, max_distance: int) -> np.ndarray:
    """``[layers, heads, max_distance + 1]``: each layer's CoPE term, averaged over every query and
    visible key ``d`` apart, in segments of ``max_distance + 1`` tokens of the split's first
    ``max(CURVE_TOKENS, 2 (max_distance + 1))`` (0 at a distance no query sees, beyond a window)."""
    model, task, _ = load_language_model(path, data)
    model.eval()
    length = max_distance + 1
    stream = token_stream(task, data, split)[:max(CURVE_TOKENS, 2 * length)]
    layers = model.decoder.layers
    heads = layers[0].self_attn.num_heads
    sums = torch.zeros(len(layers), heads, length + 1, dtype=torch.float64)  # the last bin: hidden keys
    pairs = torch.zeros(len(layers), length + 1, dtype=torch.float64)

    def accumulate(n):
        def hook(module, inputs, logits):
            _, scores, bias = inputs
            num_queries, num_keys = scores.shape[-2:]
            # a block's keys end with its last query: query t and key s are (S - T) + t - s apart
            distance = (num_keys - num_queries) + torch.arange(num_queries)[:, None] - torch.arange(num_keys)[None, :]
            hidden = ~torch.isfinite(bias)
            hidden_cells = hidden.reshape(-1, num_queries, num_keys)[0]  # alike in every head
            bins = distance.masked_fill(hidden_cells, length).flatten()
            term = (logits - scores - bias).double().masked_fill(hidden, 0.0)  # NaN and -inf at hidden keys
            sums[n].index_add_(1, bins, term.sum(dim=0).flatten(1))  # [heads, T S]
            pairs[n].index_add_(0, bins, torch.full(bins.shape, float(scores.size(0)), dtype=torch.float64))
        return hook

    hooks = [layer.self_attn.score_transform.register_forward_hook(accumulate(n)) for n, layer in enumerate(layers)]
    run_in_segments(model, stream, length, hooks, f"the {split} split of {data}")
    return (sums / pairs.clamp(min=1)[:, None, :])[:, :, :length].numpy()
