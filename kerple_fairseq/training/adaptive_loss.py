"""fairseq's ``adaptive_loss`` criterion (ALiBi's WikiText-103 recipe) with its sum in float32.

fairseq 0.12 adds the per-token losses of a batch into a tensor of the model's dtype. In fp16 a batch
of ALiBi's 9216 tokens at about 7 nats a token already passes fp16's largest value (65504), and the
loss fairseq logs is ``inf``: on an NVIDIA H200, every training and validation loss logged in the
first 200 updates of the recipe's fp16 run (docs/gpu.md). Here each token's loss is still computed by
``F.cross_entropy`` in the model's dtype, and the sum is taken in float32: the gradients are those of
fairseq's criterion, the logged loss is finite.
"""

import torch
import torch.nn.functional as F
from fairseq import utils
from fairseq.criterions.adaptive_loss import AdaptiveLoss

from kerple_core.precision import precise


def summed_in_float32(self, model, sample, reduce=True):
    """The summed loss of ``sample`` over the adaptive softmax's head and tail clusters, in float32
    (float64 for a float64 model; ``reduce=False``: fairseq's own per-token losses)."""
    if not reduce:
        return _fairseq_forward(self, model, sample, reduce)
    adaptive_softmax = model.decoder.adaptive_softmax
    assert adaptive_softmax is not None, "adaptive_loss needs a model with an adaptive softmax"
    net_output = model(**sample["net_input"])
    target = model.get_targets(sample, net_output)
    logits, cluster_targets = adaptive_softmax(net_output[0], target.reshape(-1))
    dtype = precise(net_output[0].dtype)
    loss = torch.zeros((), dtype=dtype, device=target.device)
    for cluster_logits, cluster_target in zip(logits, cluster_targets):
        if cluster_target is not None:
            per_token = F.cross_entropy(cluster_logits, cluster_target, ignore_index=self.padding_idx,
                                        reduction="none")
            loss = loss + per_token.to(dtype).sum()
    ntokens = utils.strip_pad(target.reshape(-1), self.padding_idx).numel()
    sample_size = target.size(0) if self.sentence_avg else ntokens
    logging_output = {"loss": loss.data, "ntokens": ntokens, "nsentences": target.size(0), "sample_size": sample_size}
    return loss, sample_size, logging_output


_fairseq_forward = AdaptiveLoss.forward


def install_float32_adaptive_loss() -> None:
    AdaptiveLoss.forward = summed_in_float32
