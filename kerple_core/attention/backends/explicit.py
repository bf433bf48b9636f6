"""The explicit backend: ``softmax(S * W + B) V`` with the scores ``S = q k^T`` laid out.

The reference path, which serves every block: the only one that returns the probabilities or takes an attention
method that needs the scores (a score transform: DAPE, CoPE, selective attention, PaTH, ReRoPE's merged logits; or
weights in place of the softmax: stick-breaking), and the one for key padding or a weight kernel where no fused
kernel serves them. Asked for with ``--attention-backend explicit`` (or ``--unfused-attention``).
"""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from kerple_core.attention.backends.base import AttentionBackend, AttentionCall, ScoreTransform, register_backend
from kerple_core.attention.block_bias import BlockBias
from kerple_core.precision import precise


@register_backend("explicit")
class ExplicitBackend(AttentionBackend):
    summary = ("matmul and softmax with the scores laid out, the reference path (= --unfused-attention), taken "
               "where the probabilities or the scores are needed (DAPE, CoPE, ...) and where no other serves")
    serves_every_block = True

    def takes(self, call: AttentionCall) -> bool:
        """Asked for, or wherever the probabilities or the scores are needed."""
        return call.asked is self or not call.returns_values_only

    def attend(self, call: AttentionCall) -> Tuple[Tensor, Optional[Tensor]]:
        scores = biased_scores(call.q, call.k, call.bias, call.key_padding_mask, call.score_transform)
        if call.logits_kept is not None:
            call.logits_kept.append(scores)
        sees_nothing = None
        if call.key_padding_mask is not None:
            # a padded query whose window (or chunk) holds only padding sees no key: it attends to nothing
            # (as in FlexAttention), its row computed from zeros so that neither its values nor its gradient
            # is NaN (a NaN there would reach every parameter through the backward pass)
            sees_nothing = torch.isneginf(scores).all(dim=-1, keepdim=True)
            scores = scores.masked_fill(sees_nothing, 0.0)
        if call.weights is not None:
            probabilities = call.weights(scores, call.bias.block)
        else:
            # in float32 for half-precision scores (as fairseq does), in float64 for float64 ones
            probabilities = torch.softmax(scores, dim=-1, dtype=precise(scores.dtype))
        if sees_nothing is not None:
            probabilities = probabilities.masked_fill(sees_nothing, 0.0)
        dropped = F.dropout(probabilities.type_as(call.q), p=call.dropout, training=call.dropout > 0)
        return torch.matmul(dropped, call.v), probabilities if call.need_probabilities else None


def biased_scores(q: Tensor, k: Tensor, bias: BlockBias, key_padding_mask: Optional[Tensor] = None,
                  score_transform: Optional[ScoreTransform] = None) -> Tensor:
    """``[B, H, T, S]`` logits ``(q k^T) * W + B`` (or ``score_transform`` of ``q``, ``(q k^T) * W``
    and ``B``), ``-inf`` at padded keys. In half precision the bias is added in float32 (the softmax
    reads float32 anyway), except under a score transform, whose layers run in the model's dtype."""
    scores = torch.matmul(q, k.transpose(-1, -2))
    dtype = q.dtype
    if score_transform is None and dtype in (torch.float16, torch.bfloat16):
        scores, dtype = scores.float(), torch.float32
    weight = bias.weight(dtype, q.device)
    if weight is not None:
        scores = scores * weight
    mask = bias.mask(dtype, q.device)  # [H, T, S] (broadcast over the batch) or [B, H, T, S]
    padding = None if key_padding_mask is None else key_padding_mask[:, None, None, :].to(torch.bool)
    if score_transform is not None:
        # padded keys are hidden from the transform as future keys are
        if padding is not None:
            mask = mask.masked_fill(padding, float("-inf"))
        return score_transform(q, scores, mask)
    scores += mask  # in place
    if padding is not None:
        scores.masked_fill_(padding, float("-inf"))
    return scores
