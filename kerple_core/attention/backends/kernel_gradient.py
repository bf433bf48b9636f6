"""The kernel gradient backend: on CPU, for a learnable per-head kernel in training, PyTorch's fused CPU attention
with the kernel parameters' gradient from extra fused forwards (:mod:`kerple_core.attention.kernel_gradient`)."""

from typing import Optional, Tuple

from torch import Tensor

from kerple_core.attention import kernel_gradient
from kerple_core.attention.backends.base import AttentionBackend, AttentionCall, register_backend


@register_backend("kernel gradient")
class KernelGradientBackend(AttentionBackend):
    """Not asked for by name: how SDPA's fused CPU kernel serves a learnable kernel in training, whatever the
    backend asked for (those before it in the order took the block where they serve it)."""

    summary = ("PyTorch's fused CPU attention with a learnable kernel's gradient from extra fused forwards, taken "
               f"on CPU in training from {kernel_gradient.MIN_KEYS} keys")
    nameable = False

    def takes(self, call: AttentionCall) -> bool:
        """Where it applies (:func:`~kerple_core.attention.kernel_gradient.applies`), only the values needed,
        without key padding or a weight kernel."""
        return call.through_a_mask and kernel_gradient.applies(call.q, call.k, call.bias, call.dropout)

    def attend(self, call: AttentionCall) -> Tuple[Tensor, Optional[Tensor]]:
        return kernel_gradient.attend_with_kernel_gradient(call.q, call.k, call.v, call.bias), None
