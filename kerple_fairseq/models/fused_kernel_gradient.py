"""Fused CPU attention whose learnable bias gets its gradient from fused forwards.

PyTorch's fused CPU attention returns no gradient for its mask, so a learnable bias
would send training through the unfused ``L x L`` path. The kernels' parameters are
few and per head, though, and the gradient of a parameter ``p`` needs only the
scores' gradient ``dS = P * (dP - delta)`` summed against the bias's tangent
``T = dB / dp`` (``dP = dO V^T``, ``delta_i = dO_i . O_i``):

    dL/dp_h = sum_{b,i} [ dO_i . (sum_j P_ij T_ij v_j) - delta_i sum_j P_ij T_ij ].

For ``T >= 0``, ``P_ij T_ij = softmax(S + log T)_ij * m_i`` with the row mass
``m_i = exp(lse'_i - lse_i)``, where ``lse`` and ``lse'`` are the log-sum-exps of the
scores with the bias and with the bias plus ``log T``. One fused forward with the
mask ``B + log T`` therefore gives both sums:

    dL/dp_h = sum_{b,i} m_i (dO_i . O'_i - delta_i).

A tangent of mixed sign is split into its positive and negative parts. Each parameter
costs one or two fused forwards instead of the ``L x L`` scores and their gradient, which
pays from about 512 keys on (measured on 2 CPU cores: at 128 keys the unfused path is
~1.4x faster, at 384 even, at 512 and 1024 ~1.2-1.7x slower for 2-3 parameters).
"""

from typing import Optional

import torch
from torch import Tensor

from kerple_fairseq.models.attention_bias import AttentionBias, toeplitz

FLASH_FORWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
FLASH_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
#: fewest keys for which the fused forwards beat PyTorch's unfused path with a mask gradient
MIN_KEYS = 512


class FusedKernelGradient:
    """Attention through PyTorch's fused CPU kernel for a bias with learnable per-head parameters
    (``kernel.per_head_parameters``), their gradient computed as in the module docstring."""

    def __init__(self, bias: AttentionBias, min_keys: int = MIN_KEYS):
        if not bias.kernel.per_head_parameters:
            raise TypeError(f"bias kernel {bias.kernel.name!r} does not have per-head parameters")
        self.bias = bias
        self.min_keys = min_keys

    def applies(self, q: Tensor, k: Tensor, mask: Optional[Tensor], dropout: float) -> bool:
        """On CPU, float32/float64, no attention dropout, at least ``min_keys`` keys, and a mask
        that needs a gradient."""
        return (FLASH_FORWARD is not None and mask is not None and mask.requires_grad and dropout == 0.0
                and q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64)
                and k.size(2) >= self.min_keys)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, offset: int) -> Tensor:
        """``softmax(q k^T + mask) v`` for ``q``, ``k``, ``v`` of shape ``[B, H, T, D]`` / ``[B, H, S, D]``
        (q already scaled) and the bias ``mask`` ``[1, H, T, S]``, laid out with ``offset`` (the
        first query's position minus the first key's) from the kernel's per-distance line."""
        length = offset + q.size(2)
        line = self.bias.per_distance_line("bias", length, q.dtype, q.device).detach()
        tangents = self.bias.per_distance_line("tangents", length, q.dtype, q.device)
        if not mask.is_contiguous():
            # a block laid out under autograd is strided, which the fused kernel gathers slowly on
            # every call: lay it out again, contiguously, from the line without a gradient
            mask = toeplitz(line, q.size(2), k.size(2), float("-inf"), q.dtype, offset=offset)[None]
        return _AttentionWithKernelGradient.apply(q, k, v, mask.detach(), line, tangents, offset,
                                                  *self.bias.kernel.parameters())


class _AttentionWithKernelGradient(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, mask, line, tangents, offset, *parameters):
        # contiguous once: the fused kernel gathers strided inputs on every call, and backward makes several
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        # queries and keys at the same positions: the kernel may also skip the blocks above the
        # diagonal, which every mask here has at -inf anyway
        ctx.causal = offset == 0 and q.size(2) == k.size(2)
        out, lse = FLASH_FORWARD(q, k, v, 0.0, ctx.causal, attn_mask=mask, scale=1.0)
        ctx.save_for_backward(q, k, v, mask, line, tangents, out, lse)
        ctx.offset = offset
        ctx.parameter_shapes = [(p.dtype, p.shape) for p in parameters]
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, mask, line, tangents, out, lse = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_q, grad_k, grad_v = FLASH_BACKWARD(grad_out, q, k, v, out, lse, 0.0, ctx.causal, attn_mask=mask,
                                                 scale=1.0)
        delta = (grad_out * out).sum(-1)  # [B, H, T]
        grads = []
        for tangent in tangents:  # [H, N], one per parameter
            grad = torch.zeros(tangent.size(0), dtype=torch.float64, device=q.device)
            for sign in (1.0, -1.0):
                part = (sign * tangent).clamp(min=0)
                if not bool((part > 0).any()):
                    continue
                shifted_line = line + part.log()
                shifted = toeplitz(shifted_line, q.size(2), k.size(2), float("-inf"), q.dtype, offset=ctx.offset)
                shifted_out, shifted_lse = FLASH_FORWARD(q, k, v, 0.0, ctx.causal, attn_mask=shifted[None],
                                                          scale=1.0)
                # a row with no key left (T = 0 wherever it may look) has mass 0; the fused kernel
                # reports lse 0 for it, so such rows are dropped explicitly
                alive = rows_seeing_a_key(shifted_line, q.size(2), k.size(2), ctx.offset)
                mass = (shifted_lse - lse).exp()
                per_row = mass * ((grad_out * shifted_out).sum(-1) - delta)
                grad += sign * torch.where(alive, per_row, 0.0).sum((0, 2)).double()
            grads.append(grad)
        return (grad_q, grad_k, grad_v, None, None, None, None,
                *(grad.to(dtype).view(shape) for grad, (dtype, shape) in zip(grads, ctx.parameter_shapes)))


def rows_seeing_a_key(line: Tensor, query_len: int, key_len: int, offset: int) -> Tensor:
    """``[H, query_len]``: whether query ``t`` of ``toeplitz(line, query_len, key_len, -inf, offset=offset)``
    has a finite entry, from a running count over the line (query ``t`` sees distances
    ``max(0, offset + t - key_len + 1) .. offset + t``)."""
    finite = torch.isfinite(line).to(torch.int64)
    count = torch.nn.functional.pad(finite.cumsum(-1), (1, 0))  # count[:, d] = finite distances below d
    nearest = torch.arange(offset, offset + query_len, device=line.device)
    farthest = (nearest - key_len + 1).clamp(min=0)
    return count[:, nearest + 1] > count[:, farthest]
