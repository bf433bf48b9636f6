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

import torch
from torch import Tensor

from kerple_core.attention.block_bias import BlockBias
from kerple_core.attention.distance_bias import DistanceBlockBias, toeplitz

FLASH_FORWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
FLASH_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
#: fewest keys for which the fused forwards beat PyTorch's unfused path with a mask gradient
MIN_KEYS = 512


def applies(q: Tensor, k: Tensor, bias: BlockBias, dropout: float) -> bool:
    """On CPU, float32/float64, no attention dropout, at least ``MIN_KEYS`` keys, and a distance kernel's
    bias of per-head parameters that needs a gradient, under a visibility of distances alone."""
    return (FLASH_FORWARD is not None and isinstance(bias, DistanceBlockBias) and bias.per_head_parameters
            and not bias.by_position and bias.requires_grad and dropout == 0.0
            and q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64) and k.size(2) >= MIN_KEYS)


def attend_with_kernel_gradient(q: Tensor, k: Tensor, v: Tensor, bias: DistanceBlockBias) -> Tensor:
    """``softmax(q k^T + B) v`` for ``q``, ``k``, ``v`` of shape ``[B, H, T, D]`` / ``[B, H, S, D]``
    (q already scaled) and the block's bias ``B``, laid out without autograd from the kernel's
    per-distance values; the kernel's parameters get their gradient as in the module docstring."""
    values = bias.distance_values("bias", q.dtype, q.device).detach()
    tangents = bias.distance_values("tangents", q.dtype, q.device)
    offset = bias.block.offset
    mask = toeplitz(values, q.size(2), k.size(2), float("-inf"), q.dtype, offset=offset)[None]
    return _AttentionWithKernelGradient.apply(q, k, v, mask, values, tangents, offset, *bias.parameters)


class _AttentionWithKernelGradient(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, mask, values, tangents, offset, *parameters):
        # contiguous once: the fused kernel gathers strided inputs on every call, and backward makes several
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        # queries and keys at the same positions: the kernel may also skip the blocks above the
        # diagonal, which every mask here has at -inf anyway
        ctx.causal = offset == 0 and q.size(2) == k.size(2)
        out, lse = FLASH_FORWARD(q, k, v, 0.0, ctx.causal, attn_mask=mask, scale=1.0)
        ctx.save_for_backward(q, k, v, mask, values, tangents, out, lse)
        ctx.offset = offset
        ctx.parameter_shapes = [(p.dtype, p.shape) for p in parameters]
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, mask, values, tangents, out, lse = ctx.saved_tensors
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
                shifted = values + part.log()
                shifted_mask = toeplitz(shifted, q.size(2), k.size(2), float("-inf"), q.dtype, offset=ctx.offset)
                shifted_out, shifted_lse = FLASH_FORWARD(q, k, v, 0.0, ctx.causal, attn_mask=shifted_mask[None],
                                                          scale=1.0)
                # a row with no key left (T = 0 wherever it may look) has mass 0; the fused kernel
                # reports lse 0 for it, so such rows are dropped explicitly
                alive = rows_seeing_a_key(shifted, q.size(2), k.size(2), ctx.offset)
                mass = (shifted_lse - lse).exp()
                per_row = mass * ((grad_out * shifted_out).sum(-1) - delta)
                grad += sign * torch.where(alive, per_row, 0.0).sum((0, 2)).double()
            grads.append(grad)
        return (grad_q, grad_k, grad_v, None, None, None, None,
                *(grad.to(dtype).view(shape) for grad, (dtype, shape) in zip(grads, ctx.parameter_shapes)))


def rows_seeing_a_key(per_distance: Tensor, query_len: int, key_len: int, offset: int) -> Tensor:
    """``[H, query_len]``: whether query ``t`` of ``toeplitz(per_distance, query_len, key_len, -inf,
    offset=offset)`` has a finite entry, from a running count over the distances (query ``t``
    sees distances ``max(0, offset + t - key_len + 1) .. offset + t``)."""
    finite = torch.isfinite(per_distance).to(torch.int64)
    count = torch.nn.functional.pad(finite.cumsum(-1), (1, 0))  # count[:, d] = finite distances below d
    nearest = torch.arange(offset, offset + query_len, device=per_distance.device)
    farthest = (nearest - key_len + 1).clamp(min=0)
    return count[:, nearest + 1] > count[:, farthest]
