"""Empirical receptive field with the cumulative normalized gradient (Sandwich §5.1).

For a segment of ``L`` input tokens, ``g_m`` is the gradient of the loss of the prediction
at the last position with respect to the input embedding ``e_m`` (the output of the token
embedding, before positions, scaling and dropout). ``s_m = ||g_m|| / sum_n ||g_n||``, averaged
over segments, then accumulated from the most recent token: ``c_k`` is the share held by the
``k`` most recent tokens, and the ERF is the smallest ``k`` with ``c_k > mass`` (0.99).

With ``--attn-window w`` each layer reaches back ``w - 1`` tokens, so ``R`` layers reach
``(w - 1) R + 1`` tokens: the theoretical receptive field (Sandwich writes ``wR``).
"""

import sys
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from kerple_fairseq.evaluation import spans as S


@dataclass
class ReceptiveField:
    shares: np.ndarray  # [L] mean s by distance from the last input token (0 = the last token)
    mass: float
    num_segments: int

    @property
    def cumulative(self) -> np.ndarray:
        return np.cumsum(self.shares)

    @property
    def erf(self) -> int:
        """The number of most recent tokens holding more than ``mass`` of the gradient."""
        above = np.nonzero(self.cumulative > self.mass)[0]
        return int(above[0]) + 1 if above.size else len(self.shares)

    @property
    def support(self) -> int:
        """The number of most recent tokens up to the farthest one with any gradient at all."""
        nonzero = np.nonzero(self.shares > 0)[0]
        return int(nonzero[-1]) + 1 if nonzero.size else 0


def theoretical_receptive_field(attention_window: int, num_layers: int) -> Optional[int]:
    return (attention_window - 1) * num_layers + 1 if attention_window > 0 else None


def gradient_shares(model, inputs: Tensor, targets: Tensor) -> np.ndarray:
    """``[batch, L]`` normalized gradient norms ``s_m`` for predicting ``targets`` after ``inputs``."""
    captured = []

    def make_leaf(module, args, output):
        leaf = output.detach().requires_grad_(True)
        captured.append(leaf)
        return leaf

    handle = model.decoder.embed_tokens.register_forward_hook(make_leaf)
    try:
        with torch.enable_grad():
            features, extra = model(inputs, features_only=True)
            logits = model.decoder.output_layer(features[:, -1:])
            target = targets[:, None]
            lprobs = model.get_normalized_probs((logits, extra), log_probs=True, sample={"target": target})
            loss = -lprobs.gather(-1, target[..., None]).sum()
            (grad,) = torch.autograd.grad(loss, captured[0])
    finally:
        handle.remove()
    norms = grad.double().norm(dim=-1)
    return (norms / norms.sum(dim=-1, keepdim=True)).cpu().numpy()


def receptive_field(model, stream: Tensor, length: int, num_segments: int, mass: float, max_tokens: int,
                    device, progress: bool = False) -> ReceptiveField:
    """Mean gradient shares over ``num_segments`` segments of ``length`` tokens spread evenly over ``stream``.

    Segment ``k`` is the ``length`` tokens before target ``t_k`` (the last-token protocol's
    targets for spans of ``length + 1`` tokens).
    """
    model.requires_grad_(False)  # gradients for the embeddings only; keeps the bias cached
    targets = S.last_token_targets(len(stream), length + 1, num_segments)
    batch_size = max(1, max_tokens // length)
    total = np.zeros(length)
    with tqdm(total=num_segments, desc=f"receptive field L={length}", unit="segment", file=sys.stderr,
              disable=not progress, mininterval=2.0, leave=False) as bar:
        for first in range(0, num_segments, batch_size):
            chunk = torch.as_tensor(targets[first:first + batch_size])
            inputs = torch.stack([stream[t - length:t] for t in chunk.tolist()]).to(device)
            total += gradient_shares(model, inputs, stream[chunk].to(device)).sum(axis=0)
            bar.update(len(chunk))
    return ReceptiveField(shares=total[::-1] / num_segments, mass=mass, num_segments=num_segments)
