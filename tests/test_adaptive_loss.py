"""fairseq's adaptive_loss criterion, as the plugin leaves it: in fp16 its summed loss is finite where
fairseq's own sum overflows, and equals the float64 sum; its gradients are fairseq's."""

import torch

from fairseq.criterions.adaptive_loss import AdaptiveLoss

from helpers import TinyTask, random_tokens, tiny_model
from kerple_fairseq.training import adaptive_loss

ADAPTIVE = ("--adaptive-softmax-cutoff", "20,40")


def batch(rows, length):
    tokens = random_tokens(batch=rows, length=length + 1, seed=1)
    return {"net_input": {"src_tokens": tokens[:, :-1].contiguous(), "src_lengths": torch.full((rows,), length)},
            "target": tokens[:, 1:].contiguous(), "ntokens": rows * length}


def criterion():
    return AdaptiveLoss(TinyTask(), sentence_avg=False)


def test_the_fp16_sum_is_finite_and_equals_the_float64_sum():
    torch.manual_seed(0)
    model = tiny_model("alibi", *ADAPTIVE).eval()
    with torch.no_grad():  # about 10 nats a token: 8 x 1024 tokens sum past fp16's 65504
        model.decoder.adaptive_softmax.head.weight.mul_(40)
    sample = batch(8, 1024)
    expected, _, _ = adaptive_loss.summed_in_float32(criterion(), model.double(), sample)
    assert expected.item() > 70000
    half = model.half()
    loss, sample_size, logged = adaptive_loss.summed_in_float32(criterion(), half, sample)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    torch.testing.assert_close(loss.double(), expected, rtol=2e-3, atol=0)
    assert sample_size == logged["ntokens"] == 8 * 1024 and logged["nsentences"] == 8
    fairseq_loss, _, _ = adaptive_loss._fairseq_forward(criterion(), half, sample)
    assert torch.isinf(fairseq_loss), "fairseq's own fp16 sum overflows"
    assert AdaptiveLoss.forward is adaptive_loss.summed_in_float32, "installed with the plugin"


def test_the_loss_and_gradients_equal_fairseqs_in_float32():
    torch.manual_seed(0)
    model = tiny_model("kerple_log", *ADAPTIVE).train()
    sample = batch(3, 40)
    results = []
    for forward in (adaptive_loss.summed_in_float32, adaptive_loss._fairseq_forward):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        loss, sample_size, logged = forward(criterion(), model, sample)
        loss.backward()
        results.append((loss.detach(), sample_size, logged["ntokens"],
                        {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (ours, size, ntokens, grads), (theirs, their_size, their_ntokens, their_grads) = results
    torch.testing.assert_close(ours, theirs.reshape(()), rtol=1e-6, atol=0)
    assert (size, ntokens) == (their_size, their_ntokens)
    assert grads.keys() == their_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, their_grads[name], rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")

