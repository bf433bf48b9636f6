"""DAPE: a learned function of every head's scores and bias, added to the logits (``--dape``)."""

from dataclasses import dataclass, field
from typing import Dict, List

import torch
import torch.nn.functional as F
from fairseq.dataclass import ChoiceEnum
from torch import Tensor, nn

from kerple_core.attention.methods.base import SCORES, AttentionMethod, register_attention_method
from kerple_core.errors import KernelConfigError

#: LeakyReLU's negative slope in the reference (PyTorch's default)
NEGATIVE_SLOPE = 0.01
VARIANTS = ("none", "mlp", "conv")


@dataclass
class DapeOptions:
    dape: ChoiceEnum(list(VARIANTS)) = field(default="none", metadata={
        "help": "DAPE: add a learned function of every head's scaled scores and bias to the logits (mlp: per "
        "(i, j), DAPE v1; conv: along the keys, DAPE v2); composes with every kernel and rotary; attention "
        "then runs on the explicit path, block by block"})
    dape_width: int = field(default=32, metadata={"help": "DAPE: hidden width of each layer's network"})
    dape_kernel_size: int = field(default=3, metadata={"help": "DAPE v2 (--dape conv): odd kernel size along the keys"})


@register_attention_method("dape")
class DataAdaptiveLogits(AttentionMethod):
    """``Z = S + B + g([S; B])`` for one layer: ``S`` the scaled scores ``[batch, H, T, S]``, ``B``
    the positional bias (``-inf`` at keys a query may not see), ``g`` a small network across the
    ``2H`` channels of all heads' scores and biases (Zheng et al., "DAPE: Data-Adaptive Positional
    Encoding for Length Extrapolation", NeurIPS 2024, §3).

    Cells a query may not see (future keys, keys outside a window) are zeroed in ``g``'s input and
    stay ``-inf`` in ``Z``. The attention passes one block of queries at a time, so no more than
    one block of ``[batch, 2H, queries, keys]`` exists.
    """

    options = DapeOptions
    switch = "dape"
    acts_on = SCORES

    @classmethod
    def command_lines(cls) -> Dict[str, List[str]]:
        """``dape``: v1 (``--dape mlp``); ``dape-conv``: v2."""
        return {"dape": ["--dape", "mlp"], "dape-conv": ["--dape", "conv"]}

    def __init__(self, num_heads: int, head_dim: int, dape: str = "mlp", dape_width: int = 32,
                 dape_kernel_size: int = 3):
        super().__init__()
        if dape not in VARIANTS[1:]:
            raise KernelConfigError(f"unknown --dape {dape!r}; choose one of: {', '.join(VARIANTS)}")
        if dape_width < 1:
            raise KernelConfigError(f"--dape-width must be >= 1, got {dape_width}")
        if dape_kernel_size < 1 or dape_kernel_size % 2 == 0:
            raise KernelConfigError(f"--dape-kernel-size must be odd and >= 1 (the output keeps the key axis's "
                                    f"length), got {dape_kernel_size}")
        self.g = PerCell(num_heads, dape_width) if dape == "mlp" else AlongKeys(num_heads, dape_width, dape_kernel_size)

    def forward(self, q: Tensor, scores: Tensor, bias: Tensor) -> Tensor:
        """The logits of a block from its ``scores`` and ``bias`` (its queries ``q`` are not read)."""
        visible = torch.isfinite(bias)
        bias_in = bias.masked_fill(~visible, 0.0).to(scores.dtype).expand_as(scores)
        features = torch.cat([scores.masked_fill(~visible, 0.0), bias_in], dim=1)
        return scores + bias + self.g(features)


class PerCell(nn.Module):
    """DAPE (v1): ``Linear(2H, W)``, LeakyReLU, ``Linear(W, H)`` at every ``(i, j)``."""

    def __init__(self, num_heads: int, width: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2 * num_heads, width), nn.LeakyReLU(NEGATIVE_SLOPE),
                                 nn.Linear(width, num_heads))

    def forward(self, features: Tensor) -> Tensor:
        return self.net(features.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class AlongKeys(nn.Module):
    """DAPE v2: ``Conv2d(2H, W, (1, k))``, LeakyReLU, ``Conv2d(W, H, (1, k))`` along the key axis.

    The key axis is taken as unbounded, with zero input at every cell a query may not see: the
    hidden layer is evaluated ``k // 2`` cells beyond the block's keys on either side, where it
    still depends on the nearest visible cells. The reference zero-pads each layer at the edge
    of the sequence instead, so its last query row (and, under a window, the rows at the window's
    edge) see zeros where every other row sees hidden values: a token's output then depends on
    how many tokens follow it. Here it does not, and incremental decoding equals full scoring.
    """

    def __init__(self, num_heads: int, width: int, kernel_size: int):
        super().__init__()
        self.reach = kernel_size // 2
        self.hidden = nn.Conv2d(2 * num_heads, width, (1, kernel_size), padding=(0, self.reach))
        self.activation = nn.LeakyReLU(NEGATIVE_SLOPE)
        self.out = nn.Conv2d(width, num_heads, (1, kernel_size))

    def forward(self, features: Tensor) -> Tensor:
        hidden = self.activation(self.hidden(F.pad(features, (self.reach, self.reach))))
        return self.out(hidden)
