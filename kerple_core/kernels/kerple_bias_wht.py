"""KERPLE's bias-plus-weight composite kernel."""

from torch import Tensor

from kerple_core.kernels.learnable import LearnableKernel, distance_power, stretched_exp_decay, uniform
from kerple_core.kernels.registry import register_kernel


@register_kernel("kerple_bias_wht")
class KerpleBiasWeightKernel(LearnableKernel):
    """``W_h(d) = exp(-r3_h * d^r4_h)`` multiplies the scaled logit, then ``B_h(d) = -r1_h * d^r2_h``
    is added; learnable ``r1, r3 > 0`` and ``0 < r2, r4 <= 2``.

    KERPLE (Chi et al., NeurIPS 2022), §5.3, "bias+wht": the tensor product of a
    weight kernel on the logit and the power bias kernel. The paper gives no
    initialisation; ``r1, r3 ~ U[0, 1)`` and ``r2, r4 ~ U[0, 2)`` as for the
    power variant.
    """

    has_weight = True

    def __init__(self, num_heads: int, **constraint_options):
        super().__init__(num_heads, **constraint_options)
        self.add_parameter("r1", uniform(num_heads, 1.0))
        self.add_power("r2", uniform(num_heads, 2.0))
        self.add_parameter("r3", uniform(num_heads, 1.0))
        self.add_power("r4", uniform(num_heads, 2.0))

    def forward(self, distance: Tensor) -> Tensor:
        r1, r2 = self.column("r1"), self.column("r2")
        return -r1 * distance_power(distance.to(r1.dtype), r2)

    def weight(self, distance: Tensor) -> Tensor:
        r3, r4 = self.column("r3"), self.column("r4")
        return stretched_exp_decay(distance.to(r3.dtype), r3, r4)
