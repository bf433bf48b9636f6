"""The interface every positional attention-bias kernel implements."""

from typing import ClassVar, Optional, Sequence

import torch
from torch import Tensor, nn

from kerple_core.errors import KernelConfigError
from kerple_core.precision import precise


def per_head_column(values: Sequence[float], dtype: torch.dtype, device) -> Tensor:
    """``values`` (one per head) as a ``[heads, 1]`` column, each filled on ``device``: a tensor made
    from the list would be copied from host memory, which on a GPU waits for the device."""
    return torch.stack([torch.full((1,), value, dtype=dtype, device=device) for value in values])


class BiasKernel(nn.Module):
    """A per-head function of the causal distance ``d = i - j >= 0``.

    ``forward(distance)`` takes a float32 vector of distances and returns a
    float32 ``[num_heads, len(distance)]`` tensor ``B_h(d)``, the bias added to
    the scaled attention logits. The kernel knows nothing about masks, batches
    or layers: :class:`kerple_core.attention.distance_bias.DistanceBias`
    turns it into the ``[heads, queries, keys]`` causal bias shared by all layers.

    A *weight* kernel also multiplies the scaled logits by ``W_h(d)`` before the
    bias is added (``has_weight = True``, ``weight(distance)`` gives ``W``).

    A subclass sets ``options`` to a dataclass of its command-line options
    (fields become ``--dashed-flags`` of the model) and validates them in
    ``__init__``, raising :class:`KernelConfigError` for values out of range.
    """

    name: ClassVar[str] = ""
    options: ClassVar[Optional[type]] = None
    #: the kernel multiplies the scaled logits by ``weight(distance)``
    has_weight: ClassVar[bool] = False
    #: the kernel tells distances apart (False: token or rotary positions may be added)
    encodes_position: ClassVar[bool] = True
    #: the kernel is meaningless without ``--attn-window``
    requires_window: ClassVar[bool] = False
    #: every parameter has ``num_heads`` elements and element ``h`` shapes head ``h``'s bias alone
    per_head_parameters: ClassVar[bool] = False
    #: the constructor takes ``head_dim``, the width of one attention head
    needs_head_dim: ClassVar[bool] = False

    def __init__(self, num_heads: int):
        super().__init__()
        if num_heads < 1:
            raise KernelConfigError(f"the number of attention heads must be >= 1, got {num_heads}")
        self.num_heads = num_heads
        # an empty tensor that .double(), .half() and .to() convert like any other: it carries the
        # precision asked of a kernel that has no parameters of its own; not saved in checkpoints
        self.register_buffer("precision", torch.empty(0), persistent=False)

    def compute_dtype(self) -> torch.dtype:
        """float32, or float64 when the kernel was asked for float64 (``.double()``, gradient checks)."""
        return precise(self.precision.dtype)

    def forward(self, distance: Tensor) -> Tensor:
        raise NotImplementedError

    def weight(self, distance: Tensor) -> Tensor:
        """``[num_heads, len(distance)]`` multipliers of the scaled logits (weight kernels only)."""
        raise NotImplementedError(f"bias kernel {self.name!r} has no weight")

    def linear_slopes(self) -> Optional[Sequence[float]]:
        """The slopes ``m_h`` (one per head) of a kernel that is ``B_h(d) = -m_h d`` at every distance and has no
        weight, else None: the fused attention kernel then computes the bias instead of reading its table."""
        return None

    def zeros(self, distance: Tensor) -> Tensor:
        """A ``[num_heads, len(distance)]`` zero bias in the compute dtype."""
        return torch.zeros(self.num_heads, distance.numel(), dtype=self.compute_dtype(), device=distance.device)

    def extra_repr(self) -> str:
        return f"{self.name}, heads={self.num_heads}"
