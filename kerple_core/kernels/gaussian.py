"""KERPLE's Gaussian-like kernels (Appendix A.3), as a bias or as a weight.

The paper gives no initialisation for them; here every rate or scale starts
``U[0, 1)`` and every learnable power ``U[0, 2)``, as KERPLE's power variant does.
"""

from torch import Tensor

from kerple_core.kernels.learnable import LearnableKernel, stretched_exp_decay, uniform
from kerple_core.kernels.registry import register_kernel

GAUSSIAN_POWER = 2.0


@register_kernel("gauss_bias2")
class GaussBias2Kernel(LearnableKernel):
    """``B_h(d) = r1_h * exp(-r2_h * d^2)``, learnable ``r1, r2 > 0``.

    KERPLE (Chi et al., NeurIPS 2022), Appendix A.3, "2-para-bias": the Gaussian
    kernel added to the logits.
    """

    def __init__(self, num_heads: int, **constraint_options):
        super().__init__(num_heads, **constraint_options)
        self.add_parameter("r1", uniform(num_heads, 1.0))
        self.add_parameter("r2", uniform(num_heads, 1.0))

    def forward(self, distance: Tensor) -> Tensor:
        r1, r2 = self.column("r1"), self.column("r2")
        return r1 * stretched_exp_decay(distance.to(r1.dtype), r2, GAUSSIAN_POWER)


@register_kernel("gauss_bias3")
class GaussBias3Kernel(LearnableKernel):
    """``B_h(d) = r1_h * exp(-r2_h * d^r3_h)``, learnable ``r1, r2 > 0``, ``0 < r3 <= 2``.

    KERPLE (Chi et al., NeurIPS 2022), Appendix A.3, "3-para-bias": the power of
    the Gaussian relaxed to ``(0, 2]``, where ``exp(-|x|^p)`` stays positive definite.
    """

    def __init__(self, num_heads: int, **constraint_options):
        super().__init__(num_heads, **constraint_options)
        self.add_parameter("r1", uniform(num_heads, 1.0))
        self.add_parameter("r2", uniform(num_heads, 1.0))
        self.add_power("r3", uniform(num_heads, 2.0))

    def forward(self, distance: Tensor) -> Tensor:
        r1, r2, r3 = self.column("r1"), self.column("r2"), self.column("r3")
        return r1 * stretched_exp_decay(distance.to(r1.dtype), r2, r3)


@register_kernel("gauss_wht1")
class GaussWeight1Kernel(LearnableKernel):
    """``W_h(d) = exp(-r1_h * d^2)`` multiplies the scaled logit; ``B_h(d) = 0``; learnable ``r1 > 0``.

    KERPLE (Chi et al., NeurIPS 2022), Appendix A.3, "1-para-wht": the Gaussian
    kernel as a weight.
    """

    has_weight = True

    def __init__(self, num_heads: int, **constraint_options):
        super().__init__(num_heads, **constraint_options)
        self.add_parameter("r1", uniform(num_heads, 1.0))

    def forward(self, distance: Tensor) -> Tensor:
        return self.zeros(distance)

    def weight(self, distance: Tensor) -> Tensor:
        r1 = self.column("r1")
        return stretched_exp_decay(distance.to(r1.dtype), r1, GAUSSIAN_POWER)


@register_kernel("gauss_wht2")
class GaussWeight2Kernel(LearnableKernel):
    """``W_h(d) = exp(-r1_h * d^r2_h)`` multiplies the scaled logit; ``B_h(d) = 0``;
    learnable ``r1 > 0``, ``0 < r2 <= 2``.

    KERPLE (Chi et al., NeurIPS 2022), Appendix A.3, "2-para-wht".
    """

    has_weight = True

    def __init__(self, num_heads: int, **constraint_options):
        super().__init__(num_heads, **constraint_options)
        self.add_parameter("r1", uniform(num_heads, 1.0))
        self.add_power("r2", uniform(num_heads, 2.0))

    def forward(self, distance: Tensor) -> Tensor:
        return self.zeros(distance)

    def weight(self, distance: Tensor) -> Tensor:
        r1, r2 = self.column("r1"), self.column("r2")
        return stretched_exp_decay(distance.to(r1.dtype), r1, r2)
