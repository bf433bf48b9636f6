"""FIRE: a learned function of the distance normalised by the query's position."""

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kerple_core.attention.blocks import QueryBlock
from kerple_core.attention.frozen import KeepsWhileFrozen
from kerple_core.errors import KernelConfigError
from kerple_core.layer_biases.base import LayerBias, register_layer_bias
from kerple_core.precision import precise

#: blocks kept while the parameters are frozen, and the largest kept (one block of 1024 queries and keys)
FROZEN_BLOCKS = 2
FROZEN_CELLS = 1 << 20
#: added to the normaliser, as in the reference
NORMALISER_EPS = 1e-6
#: cells of ``queries x keys x width`` evaluated at once without autograd (bounds the MLP's temporary)
CELLS_AT_ONCE = 1 << 22


@dataclass
class FireOptions:
    fire_mlp_width: int = field(default=32, metadata={"help": "FIRE: hidden width of each layer's MLP"})
    fire_threshold: float = field(
        default=0.0,
        metadata={"help": "FIRE: initial threshold L0 of the normaliser psi(max(L, i)) (L = |m * L0|, m learned "
                  "from 1); 0: an eighth of --tokens-per-sample, the reference's 64 for a training length of 512"})


@register_layer_bias("fire")
class FireBias(KeepsWhileFrozen, LayerBias):
    """``b_h(i, j) = MLP(psi(i - j) / (psi(max(L, i)) + eps))_h``, ``psi(x) = log(|c| x + 1)`` (Li et al.,
    "Functional Interpolation for Relative Positions Improves Long Context Transformers", 2023, §3;
    as in the DAPE repository's implementation, whose configs start ``L0`` at 64 for a
    training length of 512: an eighth of it is the default here).

    The MLP is ``Linear(1, W)``, ReLU, ``Linear(W, H)``; ``c`` is learned from 0.1 and used as
    ``|c|``; the threshold ``L = |m * L0|`` has a learned multiplier ``m`` (from 1) and a fixed
    ``L0`` saved with the model; ``eps = 1e-6`` is added to the normaliser. The normaliser is the query's own position ``i`` (0-based) once
    it passes ``L``, so rows beyond ``L`` are not Toeplitz: the bias is evaluated per block from
    the absolute positions of its queries and keys. One set of parameters per layer, as in the
    reference.
    """

    options = FireOptions
    needs_train_length = True

    def __init__(self, num_heads: int, embed_dim: int, fire_mlp_width: int = 32, fire_threshold: float = 0.0,
                 train_length: Optional[int] = None):
        super().__init__(num_heads, embed_dim)
        if fire_mlp_width < 1:
            raise KernelConfigError(f"--fire-mlp-width must be >= 1, got {fire_mlp_width}")
        if fire_threshold < 0:
            raise KernelConfigError(f"--fire-threshold must be >= 0 (0: an eighth of --tokens-per-sample), "
                                    f"got {fire_threshold}")
        if fire_threshold == 0:
            if not train_length:
                raise KernelConfigError("--bias-kernel fire needs --fire-threshold L0 > 0 or --tokens-per-sample")
            fire_threshold = train_length / 8
        self.hidden = nn.Linear(1, fire_mlp_width)
        self.out = nn.Linear(fire_mlp_width, num_heads)
        self.c = nn.Parameter(torch.tensor(0.1))
        self.threshold_multiplier = nn.Parameter(torch.tensor(1.0))
        self.register_buffer("threshold_base", torch.tensor(float(fire_threshold)))
        self._frozen: Dict[Tuple, Tensor] = {}

    def drop_kept(self) -> None:
        self._frozen.clear()

    def threshold(self) -> Tensor:
        return (self.threshold_multiplier * self.threshold_base).abs()

    def normalised_distance(self, block: QueryBlock, first_position: int):
        """``u(query, key) = psi(d) / (psi(max(L, i)) + eps)`` of one block's cells as a function of their
        indices (broadcasting; the form of a score term), ``i`` the query's absolute position and ``d`` its
        distance to the key (0 for future keys, which are masked later); float32 (float64 in a float64
        module). Both :meth:`score_term` and :meth:`block_bias` read the bias's input from it."""
        dtype = precise(self.c.dtype)
        c = self.c.to(dtype).abs().reshape(1)
        threshold = self.threshold().to(dtype).reshape(1)
        # a Python float read in the term becomes a symbolic scalar that PyTorch 2.11's compiler cannot
        # lower ("unbacked_bindings"): the constant is captured as a tensor
        eps = torch.full((1,), NORMALISER_EPS, dtype=dtype, device=c.device)
        first_query = torch.full((1,), first_position + block.query_start, dtype=torch.int64, device=c.device)
        offset = torch.full((1,), block.offset, dtype=torch.int64, device=c.device)

        def normalised(query, key):
            distance = (query + offset[0] - key).clamp(min=0).to(dtype)
            position = (query + first_query[0]).to(dtype)
            return torch.log1p(c[0] * distance) / (torch.log1p(c[0] * torch.maximum(position, threshold[0])) + eps[0])
        return normalised

    def mlp(self, u: Tensor) -> Tensor:
        """``[H, T, S]`` from normalised distances ``u`` ``[T, S]``."""
        hidden = F.relu(F.linear(u[..., None], self.hidden.weight.to(u.dtype), self.hidden.bias.to(u.dtype)))
        return F.linear(hidden, self.out.weight.to(u.dtype), self.out.bias.to(u.dtype)).permute(2, 0, 1)

    def curves(self, max_distance: int, inputs: Optional[Tensor] = None) -> Tensor:
        """The row of the query at position ``i = max_distance``: ``b_h(i, i - d) - b_h(i, i)`` for
        ``d = 0 .. i`` (relative to the query's own key: softmax ignores a row's constant)."""
        with torch.no_grad():
            row = self.block_bias(QueryBlock(0, 1, 0, max_distance + 1, max_distance), max_distance, None)[:, 0]
        row = row.flip(-1).float()
        return row - row[:, :1]

    def curves_description(self, max_distance: int) -> str:
        return f"query at i = {max_distance}, relative to d = 0"

    def block_bias(self, block: QueryBlock, first_position: int, state: Optional[Tensor]) -> Tensor:
        """The same normalised distance as :meth:`score_term`'s, read at every cell at once, with the MLP
        evaluated as two matrix products where the term sums its hidden units one by one (the form
        FlexAttention's compiler takes): laid out from the term, a block of 512 queries of 8 heads with
        its gradient took 5.3x as long on 2 CPU cores (2.0 s against 0.38 s).
        Computed for each block while the parameters learn; while they are frozen (evaluation), the
        last few blocks of up to :data:`FROZEN_CELLS` cells are kept, keyed on the block's geometry and
        the versions of the parameters and buffers (:mod:`kerple_core.attention.frozen`)."""
        if (torch.is_grad_enabled() and self.c.requires_grad) or block.num_queries * block.num_keys > FROZEN_CELLS:
            return self._block_bias(block, first_position)
        key = (block.num_queries, block.num_keys, block.offset, first_position + block.query_start, self.c.dtype,
               self.c.device, self.frozen_key())
        bias = self._frozen.pop(key, None)
        if bias is None:
            bias = self._block_bias(block, first_position)
        self._frozen[key] = bias  # the most recent last
        while len(self._frozen) > FROZEN_BLOCKS:
            self._frozen.pop(next(iter(self._frozen)))
        return bias

    def score_term(self, block: QueryBlock, first_position: int, state: Optional[Tensor]):
        """The bias of one cell: the MLP of its normalised distance, its hidden units summed one by one."""
        normalised = self.normalised_distance(block, first_position)
        dtype = precise(self.c.dtype)
        hidden_weight, hidden_bias = self.hidden.weight.to(dtype).reshape(-1), self.hidden.bias.to(dtype)
        out_weight, out_bias = self.out.weight.to(dtype), self.out.bias.to(dtype)
        width = hidden_bias.numel()

        def term(b, h, query, key):
            u = normalised(query, key)
            total = out_bias[h]
            for unit in range(width):
                total = total + out_weight[h, unit] * torch.relu(u * hidden_weight[unit] + hidden_bias[unit])
            return total
        return term

    def _block_bias(self, block: QueryBlock, first_position: int) -> Tensor:
        normalised = self.normalised_distance(block, first_position)
        queries = torch.arange(block.num_queries, device=self.c.device)[:, None]
        keys = torch.arange(block.num_keys, device=self.c.device)[None, :]
        rows = block.num_queries
        if not (torch.is_grad_enabled() and self.c.requires_grad):
            rows = max(1, CELLS_AT_ONCE // (block.num_keys * self.hidden.out_features))
        pieces = [self.mlp(normalised(queries[r:r + rows], keys)) for r in range(0, block.num_queries, rows)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)
