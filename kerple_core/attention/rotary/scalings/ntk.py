"""NTK-aware scaling (``--rotary-scaling ntk``; bloc97, 2023, "NTK-Aware Scaled RoPE allows LLaMA models
to have extended (8k+) context size without any fine-tuning and minimal perplexity degradation"): the
rotation's base ``b = 10000`` becomes ``b' = b s^(D / (D - 2))`` at the scale
``s = max(1, --rotary-scaling-length / training length)``, so the lowest frequency is interpolated by
``1/s`` and the highest kept."""

from kerple_core.attention.rotary.scalings.base import RotaryScaling, register_rotary_scaling


@register_rotary_scaling("ntk")
class NTKAware(RotaryScaling):
    precedence = 1

    def base(self, rotary, base: float, s: float) -> float:
        return base * s ** (rotary.head_dim / (rotary.head_dim - 2))
