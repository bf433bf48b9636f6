"""xPos (``--rotary-xpos``; Sun et al., 2023, "A Length-Extrapolatable Transformer", §3.2): pair ``k`` of
the logit of query ``n`` and key ``m`` is multiplied by ``zeta_k^((n - m) / scale_base)``,
``zeta_k = (2k + 0.4 D) / (1.4 D)``.

The reference scales the query by ``zeta^(n / scale_base)`` and the key by ``zeta^(-m / scale_base)``,
which overflow (keys) and underflow (queries) in fp16 at long positions. Both are measured here from the
block's last query ``c`` instead: ``zeta^((n - c) / scale_base)`` (at most ``zeta_0^(-block / scale_base)``,
12 for a block of 1024 queries) and ``zeta^((c - m) / scale_base)`` (at most 1); the product is the same.
The cache keeps the keys before this scaling."""

from dataclasses import dataclass, field

import torch
from torch import Tensor

from kerple_core.attention.rotary.scalings.base import RotaryScaling, register_rotary_scaling
from kerple_core.errors import KernelConfigError

#: xPos's default scale base (its ``scale_base``)
XPOS_SCALE_BASE = 512.0


@dataclass
class XPosOptions:
    rotary_xpos: bool = field(default=False, metadata={
        "help": "xPos: with --rotary-embeddings, pair k of each logit decays as "
        "zeta_k^((i - j) / --xpos-scale-base), zeta_k = (2k + 0.4 D) / (1.4 D)"})
    xpos_scale_base: float = field(default=XPOS_SCALE_BASE, metadata={"help": "xPos: the decay's scale base"})


@register_rotary_scaling("xpos")
class XPos(RotaryScaling):
    options = XPosOptions
    switch = "rotary_xpos"
    precedence = 10
    beyond_rotation = True

    def check_options(self, rotary) -> None:
        if rotary.xpos_scale_base <= 0:
            raise KernelConfigError(f"--xpos-scale-base must be > 0, got {rotary.xpos_scale_base}")

    @staticmethod
    def zeta(head_dim: int, device=None) -> Tensor:
        """``zeta_k = (2k + 0.4 D) / (1.4 D)`` of each pair ``k``, float64 ``[D/2]``."""
        k = torch.arange(head_dim // 2, dtype=torch.float64, device=device)
        return (2 * k + 0.4 * head_dim) / (1.4 * head_dim)

    def per_block(self, rotary, q, k, first_query: int, first_key: int):
        """The decay of the block's queries and keys, measured from its last query."""
        zeta = self.zeta(rotary.head_dim, q.device)
        last_query = first_query + q.size(-2) - 1
        query_steps = torch.arange(first_query - last_query, 1, dtype=torch.float64, device=q.device)
        key_steps = torch.arange(last_query - first_key, last_query - first_key - k.size(-2), -1,
                                 dtype=torch.float64, device=q.device)

        def scales(steps: Tensor, dtype: torch.dtype) -> Tensor:
            per_pair = zeta[None, :] ** (steps[:, None] / float(rotary.xpos_scale_base))  # [T, D/2]
            return torch.cat([per_pair, per_pair], dim=-1).to(dtype)  # pairs (k, k + D/2)

        return q * scales(query_steps, q.dtype), k * scales(key_steps, k.dtype)

    def describe(self, rotary) -> str:
        return f", xpos (scale base {float(rotary.xpos_scale_base):g})"
