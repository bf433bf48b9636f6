"""The Forgetting Transformer's bias: the running sum of learned forget gates between two positions."""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kerple_core.attention.blocks import QueryBlock
from kerple_core.layer_biases.base import LayerBias, register_layer_bias
from kerple_core.precision import precise

#: standard deviation of the gate projection's initial weights (the reference's initializer_range)
GATE_INIT_STD = 0.02


class ForgetGates(LayerBias):
    """``D_ij = sum_{l=j+1..i} log f_l = c_i - c_j`` with ``c = cumsum(log f)`` over the layer's
    forget gates ``f`` (:meth:`gate_logits` gives their logits). ``log f`` and ``c`` are float32
    (float64 in a float64 model); the state kept per key is ``c``, so incremental decoding extends
    it from the cached value of the last position."""

    curves_need_inputs = True
    term_is_state_difference = True

    def gate_logits(self, x: Tensor) -> Tensor:
        """``[batch, heads, T]`` logits of the forget gates for the layer input ``x`` ``[T, batch, E]``."""
        raise NotImplementedError

    def curves(self, max_distance: int, inputs: Optional[Tensor] = None) -> Tensor:
        """``d`` times the mean log forget gate of each head over ``inputs``: the mean decay."""
        if inputs is None:
            raise ValueError(f"the {self.name} bias depends on the layer's inputs: give them")
        with torch.no_grad():
            mean = F.logsigmoid(self.gate_logits(inputs).float()).mean(dim=(0, 2))
        return mean[:, None] * torch.arange(max_distance + 1, dtype=torch.float32)

    def curves_description(self, max_distance: int) -> str:
        return "mean forget-gate decay"

    def key_state(self, x: Tensor, previous: Optional[Tensor]) -> Tensor:
        logits = self.gate_logits(x)
        log_forget = F.logsigmoid(logits.to(precise(logits.dtype)))
        state = torch.cumsum(log_forget, dim=-1)
        return state if previous is None else state + previous[..., -1:]

    def score_term(self, block: QueryBlock, first_position: int, state: Optional[Tensor]):
        keys = state[:, :, block.key_start:block.key_end].contiguous()
        offset = torch.full((1,), block.offset, dtype=torch.int64, device=state.device)
        # query t of the block is key offset + t
        return lambda b, h, query, key: keys[b, h, query + offset[0]] - keys[b, h, key]


@register_layer_bias("fox")
class ForgetGateBias(ForgetGates):
    """The Forgetting Transformer's forget gate ``f_t = sigmoid(w_h . x_t + b_h)`` of head ``h``, read
    from the layer's input ``x_t`` (after the pre-LayerNorm) by a ``Linear(E, H)`` per layer; the
    bias is ``D_ij = c_i - c_j``, ``c = cumsum(log f)`` (Lin et al., "Forgetting Transformer: Softmax
    Attention with a Forget Gate", ICLR 2025, §2-3; the basic FoX, without the "Pro" additions).
    Initialised as in the reference: weights ``N(0, 0.02^2)``, bias 0."""

    def __init__(self, num_heads: int, embed_dim: int):
        super().__init__(num_heads, embed_dim)
        self.gate = nn.Linear(embed_dim, num_heads)
        nn.init.normal_(self.gate.weight, std=GATE_INIT_STD)
        nn.init.zeros_(self.gate.bias)

    def gate_logits(self, x: Tensor) -> Tensor:
        return self.gate(x).permute(1, 2, 0)


@register_layer_bias("fox_bias_only")
class ForgetBiasOnly(ForgetGates):
    """The data-independent Forgetting Transformer: ``f_h = sigmoid(b_h)`` for every position, so
    ``D_ij = (i - j) log sigmoid(b_h)``, ALiBi with the learned slope ``-log sigmoid(b_h)`` per
    head and layer (Lin et al., ICLR 2025, the "bias-only" gate). ``b`` starts at 0, as in the
    reference (slope ``log 2``)."""

    curves_need_inputs = False

    def __init__(self, num_heads: int, embed_dim: int):
        super().__init__(num_heads, embed_dim)
        self.gate_bias = nn.Parameter(torch.zeros(num_heads))

    def curves(self, max_distance: int, inputs: Optional[Tensor] = None) -> Tensor:
        return super().curves(max_distance, torch.zeros(1, 1, self.embed_dim))

    def curves_description(self, max_distance: int) -> str:
        return "learned decay"

    def gate_logits(self, x: Tensor) -> Tensor:
        return self.gate_bias[None, :, None].expand(x.size(1), -1, x.size(0))
