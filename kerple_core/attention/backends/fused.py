"""The fused backend: the Triton kernel of :mod:`kerple_core.attention.fused` (FlashAttention-2's tiling, the bias
read per distance in float32 inside the kernel, attention dropout included), on CUDA GPUs with Triton."""

from typing import Optional, Tuple

import torch
from torch import Tensor

from kerple_core.attention import fused
from kerple_core.attention.backends.base import AttentionBackend, AttentionCall, register_backend


@register_backend("fused")
class FusedBackend(AttentionBackend):
    """Taken by ``auto`` on CUDA wherever it serves (training, with any dropout, and evaluation); refused in one line
    where asked for on a device it cannot run on; set aside by ``auto`` where it fails to build."""

    summary = ("a Triton kernel reading the per-distance bias and FoX's gates, dropout included (CUDA, or CPU under "
               "TRITON_INTERPRET=1), taken on CUDA wherever it serves")

    def unavailable(self, device: torch.device) -> Optional[str]:
        return None if fused.runs_on(device) else fused.not_running_on(device)

    def takes(self, call: AttentionCall) -> bool:
        auto_on_cuda = call.asked is None and call.q.device.type == "cuda"
        return call.returns_values_only and (call.asked is self or auto_on_cuda) and fused.serves(call.q, call.bias)

    def attend(self, call: AttentionCall) -> Tuple[Tensor, Optional[Tensor]]:
        return fused.attend(call.q, call.k, call.v, call.bias, dropout=call.dropout,
                            key_padding_mask=call.key_padding_mask), None

    def build_errors(self) -> tuple:
        return fused.kernel_errors()

    def set_aside(self, error: Exception) -> None:
        fused.set_aside(error)
