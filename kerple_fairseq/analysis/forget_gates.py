"""Where a content-dependent forget gate (FoX) closes on the retrieval tasks' examples.

FoX's bias between query ``i`` and key ``j`` is ``sum_{l=j+1..i} log f_l`` (Lin et al., "Forgetting
Transformer", ICLR 2025, section 2), each ``f_l`` read from the layer's input at position ``l``: a token
whose gate closes (``log f`` far below 0) cuts every later query off from every earlier key. Over examples
of a retrieval task this gives, per layer and head, the mean ``log f`` at each kind of symbol (each marker,
content, digit, filler), and for each scored answer the bias its source gets from the query that has to find
it, ``sum log f`` over the positions after the source up to the query: the median over the answers.
"""

from dataclasses import dataclass
from typing import Dict, List

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from kerple_core.layer_biases.fox import ForgetGates
from kerple_core.precision import precise
from kerple_fairseq.analysis.layer_bias_curves import keep_attention_inputs
from kerple_fairseq.errors import UsageError
from kerple_fairseq.tasks.retrieval_sequences import MARKERS


@dataclass
class ForgetGateReading:
    task: str
    mean_log_forget: Dict[str, np.ndarray]  # [layers, heads] mean log f at each kind of symbol
    count: Dict[str, int]  # how many positions of each kind the means are over
    source_bias: np.ndarray  # [layers, heads]: median over the answers of the bias of its source from its query


def symbol_kind(symbol: str) -> str:
    """A retrieval symbol's kind: the marker itself, or content (``c``), digit (``d``) or filler (``f``)."""
    return symbol if symbol in MARKERS else {"c": "content", "d": "digit", "f": "filler"}[symbol[0]]


def forget_gates_of(model) -> List[ForgetGates]:
    """Each layer's forget gates; a :class:`UsageError` for a model whose layers have none."""
    gates = [getattr(layer.self_attn, "layer_bias", None) for layer in model.decoder.layers]
    if not all(isinstance(g, ForgetGates) for g in gates):
        raise UsageError("the model has no forget gates in its layers (a FoX model has): nothing to read")
    return gates


def log_forget(model, gates: List[ForgetGates], tokens: Tensor) -> List[Tensor]:
    """Each layer's ``log f`` ``[T, heads]`` (float64) for one example's ``tokens`` ``[T]``, from the inputs its
    attention gets in a forward pass, in the precision the layer computes it in."""
    inputs, hooks = keep_attention_inputs(model)
    try:
        with torch.no_grad():
            model(tokens[None, :])
            logits = [g.gate_logits(x[0]) for g, x in zip(gates, inputs)]
    finally:
        for hook in hooks:
            hook.remove()
    return [F.logsigmoid(z.to(precise(z.dtype)))[0].T.double() for z in logits]


def read_forget_gates(model, dataset, dictionary, num_examples: int) -> ForgetGateReading:
    """The gates of ``model`` (:func:`forget_gates_of`) over the first ``num_examples`` of a retrieval ``dataset``
    of one task."""
    gates = forget_gates_of(model)
    sums: Dict[str, Tensor] = {}
    count: Dict[str, int] = {}
    source_bias = []
    for index in range(num_examples):
        example = dataset.example(index)
        tokens = torch.as_tensor(example.tokens[:-1])  # the target of the last position is not an input
        per_layer = torch.stack(log_forget(model, gates, tokens))  # [layers, T, heads]
        kinds = [symbol_kind(dictionary[t]) for t in tokens.tolist()]
        for kind in set(kinds):
            at = torch.tensor([k == kind for k in kinds])
            sums[kind] = sums.get(kind, 0) + per_layer[:, at].sum(dim=1)
            count[kind] = count.get(kind, 0) + int(at.sum())
        running = per_layer.cumsum(dim=1)
        source_bias.extend(running[:, query] - running[:, source] for query, source in zip(example.answers, example.sources))
    return ForgetGateReading(dataset.tasks[0], {k: (s / count[k]).numpy() for k, s in sorted(sums.items())},
                             dict(sorted(count.items())), np.median(torch.stack(source_bias).numpy(), axis=0))
