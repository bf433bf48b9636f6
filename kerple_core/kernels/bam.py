"""BAM: a learned generalised-Gaussian prior over positions (Bianchessi et al., ICLR 2026)."""

import math
from dataclasses import dataclass, field
from typing import Dict

import torch
from torch import Tensor, nn

from kerple_core.errors import KernelConfigError
from kerple_core.kernels.alibi import alibi_slopes
from kerple_core.kernels.base import BiasKernel
from kerple_core.kernels.registry import register_kernel

#: added to ``|d + mu|`` before the power, as the reference does (a finite bias at ``d = -mu`` for ``beta < 0``)
BAM_EPS = 1e-5
#: ``--bam-scale-init`` that starts every head at its ALiBi slope (the reference's default)
SLOPE = "slope"


@dataclass
class BamOptions:
    bam_shape_init: float = field(default=1.0, metadata={
        "help": "BAM: the initial shape beta of every head (the reference's 1: with the slope scale, ALiBi "
        "up to a constant per head); negative values start heads that favour distant keys"})
    bam_scale_init: str = field(default=SLOPE, metadata={
        "help": "BAM: the initial multiplier of each head: slope (ALiBi's slope m_h, the reference's default) "
        "or a number a > 0 (every head 1/a, as the reference's BAM-SSMax model of May 2025 reads it)"})
    bam_loc_init: float = field(default=0.0, metadata={
        "help": "BAM: the initial stored location l of every head (the prior's centre is 2 sinh(l) keys away)"})
    bam_loc_trainable: bool = field(default=False, metadata={
        "help": "BAM: learn the location l of every head (the reference's --theta_mu_trainable 1); without it the "
        "location stays at --bam-loc-init, as the reference trains it"})


def initial_log_scales(num_heads: int, scale_init: str) -> Tensor:
    """``log`` of each head's initial multiplier: ALiBi's slopes, or ``1 / a`` for a number ``a > 0``."""
    if str(scale_init) == SLOPE:
        return torch.tensor(alibi_slopes(num_heads), dtype=torch.float32).log()
    try:
        a = float(scale_init)
    except ValueError:
        a = math.nan
    if not (math.isfinite(a) and a > 0):
        raise KernelConfigError(f"--bam-scale-init must be {SLOPE} or a finite number > 0, got {scale_init!r}")
    return torch.full((num_heads,), -math.log(a))


@register_kernel("bam")
class BamKernel(BiasKernel):
    """``B_h(d) = -e^{s_h} (|d + mu_h| + eps)^{beta_h}``, ``mu_h = 2 sinh(l_h)``, ``eps = 1e-5``; learnable
    shape ``beta_h`` (any sign) and log-scale ``s_h``, none constrained; the location ``l_h`` held at its
    initial value, as the reference trains it (``theta_mu``, learned only with ``--theta_mu_trainable 1``),
    and learned with ``--bam-loc-trainable``.

    BAM, the Bayesian Attention Mechanism (Bianchessi et al., ICLR 2026; arXiv 2505.22842), §2.3 (GGD-BAM):
    a generalised-Gaussian prior over the key's position, ``-|(i - j - m_h) / alpha_h|^beta_h`` with ``m_h = -mu_h`` and
    ``alpha_h = e^{-s_h / beta_h}``, in the reference code's form (``ArthurSBianchessi/BAM``,
    ``AttentionPrior``: the relative position ``j - i``, the location ``2 sinh(l)``, the scale stored as its
    log, ``eps`` inside the power). Initialised as the reference's script of May 2025: ``beta = 1``, ``e^s``
    ALiBi's slope, ``l = 0``, so that at the start it is ALiBi up to ``-m_h eps`` per head, which the softmax
    ignores (its current script starts flat, ``beta = 0``, ``s = 0``: ``--bam-shape-init 0
    --bam-scale-init 1``). With ``mu = 0`` and ``0 < beta <= 2`` it is KERPLE's power kernel (``r1 = e^s``, ``r2 = beta``)
    but for ``eps``; ``beta < 0`` gives heads that favour distant keys. The paper pairs it with scalable
    softmax scaling the whole logit (``--ssmax``).
    """

    options = BamOptions
    per_head_parameters = True

    def __init__(self, num_heads: int, bam_shape_init: float = 1.0, bam_scale_init: str = SLOPE,
                 bam_loc_init: float = 0.0, bam_loc_trainable: bool = False):
        super().__init__(num_heads)
        for flag, value in (("--bam-shape-init", bam_shape_init), ("--bam-loc-init", bam_loc_init)):
            if not math.isfinite(value):
                raise KernelConfigError(f"{flag} must be a finite number, got {value}")
        self.eps = BAM_EPS
        self.shape = nn.Parameter(torch.full((num_heads,), float(bam_shape_init)))
        self.scale = nn.Parameter(initial_log_scales(num_heads, bam_scale_init))
        self.loc = nn.Parameter(torch.full((num_heads,), float(bam_loc_init)), requires_grad=bool(bam_loc_trainable))

    def forward(self, distance: Tensor) -> Tensor:
        dtype = self.compute_dtype()
        shape, scale, loc = (p.to(dtype)[:, None] for p in (self.shape, self.scale, self.loc))
        centred = distance.to(dtype) + 2.0 * torch.sinh(loc)
        return -scale.exp() * (centred.abs() + self.eps).pow(shape)

    def values(self) -> Dict[str, Tensor]:
        """The shape ``beta``, the multiplier ``e^s`` and the location ``mu = 2 sinh(l)`` of each head."""
        dtype = self.compute_dtype()
        return {"shape": self.shape.to(dtype), "scale": self.scale.to(dtype).exp(),
                "location": 2.0 * torch.sinh(self.loc.to(dtype))}
