"""How much attention each layer gives to keys ``d`` tokens back: the effective attention by distance.

For methods whose recency comes from the content rather than a distance kernel (stick-breaking
attention, selective attention, FoX) there is no bias curve to draw; their attention weights are the
thing to look at. Over segments of ``L`` tokens, the weight each query gives to the key ``d`` positions
before it is averaged over every query that has such a key, per layer and head (``w_d``; stick-breaking's
remainder counts at ``d = 0``, where the output takes it). ``sum_d w_d`` over a query's row is 1, and
the mean attended distance of a layer is ``sum_i sum_j (i - j) A_ij / L`` over the segments' queries.
"""

import sys
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm


@dataclass
class AttentionByDistance:
    weights: np.ndarray  # [layers, heads, L]: mean weight on the key d back, over queries with one
    mean_distance: np.ndarray  # [layers, heads]: mean over queries of their attended distance
    num_segments: int


def attention_weights(model, inputs: Tensor):
    """Each layer's attention weights ``[heads, batch, T, T]`` (float32) for the ``inputs`` ``[batch, T]``."""
    captured, handles = [], []

    def ask_for_weights(module, args, kwargs):
        return args, {**kwargs, "need_head_weights": True}

    def keep(module, args, output):
        captured.append(output[1].float())

    for layer in model.decoder.layers:
        handles.append(layer.self_attn.register_forward_pre_hook(ask_for_weights, with_kwargs=True))
        handles.append(layer.self_attn.register_forward_hook(keep))
    try:
        with torch.no_grad():
            model(inputs)
    finally:
        for handle in handles:
            handle.remove()
    return captured


def attention_by_distance(model, stream: Tensor, length: int, num_segments: int, max_tokens: int, device,
                          progress: bool = False) -> AttentionByDistance:
    """The mean weight by distance over the first ``num_segments`` non-overlapping segments of
    ``length`` tokens of ``stream``."""
    if len(stream) < num_segments * length:
        raise ValueError(f"the split has {len(stream)} tokens: too few for {num_segments} segments of {length}")
    layers, heads = len(model.decoder.layers), model.decoder.layers[0].self_attn.num_heads
    query = torch.arange(length)[:, None]
    distance = (query - torch.arange(length)[None, :])
    visible = distance >= 0
    index = distance[visible].to(device)  # the distance of each visible (query, key) cell
    sums = torch.zeros(layers, heads, length, dtype=torch.float64, device=device)
    batch_size = max(1, max_tokens // length)
    with tqdm(total=num_segments, desc=f"attention by distance L={length}", unit="segment", file=sys.stderr,
              disable=not progress, mininterval=2.0, leave=False) as bar:
        for first in range(0, num_segments, batch_size):
            count = min(batch_size, num_segments - first)
            inputs = stream[first * length:(first + count) * length].view(count, length).to(device)
            for layer, weights in enumerate(attention_weights(model, inputs)):
                cells = weights.sum(dim=1)[:, visible.to(device)].double()  # [heads, visible cells]
                sums[layer].index_add_(1, index, cells)
            bar.update(count)
    queries_with = (length - torch.arange(length, dtype=torch.float64, device=device)) * num_segments
    mean_distance = (sums * torch.arange(length, dtype=torch.float64, device=device)).sum(-1) / (length * num_segments)
    return AttentionByDistance((sums / queries_with).cpu().numpy(), mean_distance.cpu().numpy(), num_segments)
