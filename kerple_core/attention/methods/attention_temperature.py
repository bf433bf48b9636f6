"""Llama 4's attention temperature on the queries (``--attn-temperature-tuning``)."""

import math
from dataclasses import dataclass, field

import torch
from fairseq.dataclass import ChoiceEnum
from torch import Tensor

from kerple_core.attention.methods.base import register_attention_method
from kerple_core.attention.methods.position_factor import PositionFactor
from kerple_core.errors import KernelConfigError
from kerple_core.kernels.registry import SAVED_BEFORE

#: Llama 4's ``floor_scale`` and ``attn_scale`` (transformers' ``Llama4TextConfig``)
TEMPERATURE_FLOOR_SCALE, TEMPERATURE_SCALE = 8192, 0.1
#: the layers it acts in: those without rotary embeddings (Llama 4's), or every one
TEMPERATURE_LAYERS = ["nope", "all"]


@dataclass
class TemperatureOptions:
    attn_temperature_tuning: bool = field(default=False, metadata={
        "help": "Llama 4's attention temperature: the query at position i times 1 + --attn-temperature-scale * "
        "log(floor((i + 1) / --attn-temperature-floor-scale) + 1); for evaluation of any model: "
        "--model-overrides \"{'attn_temperature_tuning': True}\""})
    attn_temperature_floor_scale: int = field(default=TEMPERATURE_FLOOR_SCALE, metadata={
        "help": "Llama 4's attention temperature: positions per step of the floor (its floor_scale)"})
    attn_temperature_scale: float = field(default=TEMPERATURE_SCALE, metadata={
        "help": "Llama 4's attention temperature: beta (its attn_scale)"})
    attn_temperature_layers: ChoiceEnum(TEMPERATURE_LAYERS) = field(default="nope", metadata={
        "help": "Llama 4's attention temperature: in the layers without rotary embeddings (nope, Llama 4's rule) "
        "or in every layer (all)", SAVED_BEFORE: "all"})


@register_attention_method("attn_temperature")
class AttentionTemperature(PositionFactor):
    """Llama 4's attention temperature tuning (Meta, 2025; transformers' ``Llama4TextAttention``): the
    query at position ``i`` is multiplied by ``1 + beta * log(floor((i + 1) / F) + 1)``, 1 before
    position ``F - 1``, growing with the log of the length beyond it. The logits ``q . k`` scale and a
    positional bias added to them does not; every backend serves it. As in Llama 4, it acts only in the
    layers without rotary embeddings (``--attn-temperature-layers all``: in every layer). An
    inference-time factor with no parameters, usable on any trained model."""

    options = TemperatureOptions
    switch = "attn_temperature_tuning"
    layer_rule = ("acts in the layers without rotary embeddings only (Llama 4's rule; --attn-temperature-layers all: "
                  "in every layer)")

    @classmethod
    def acts_in_layer(cls, cfg, rotary: bool) -> bool:
        return not rotary or str(getattr(cfg, "attn_temperature_layers", "nope")) == "all"

    def __init__(self, num_heads: int = 0, head_dim: int = 0, attn_temperature_tuning: bool = True,
                 attn_temperature_floor_scale: int = TEMPERATURE_FLOOR_SCALE,
                 attn_temperature_scale: float = TEMPERATURE_SCALE, attn_temperature_layers: str = "nope"):
        super().__init__()
        if str(attn_temperature_layers) not in TEMPERATURE_LAYERS:
            raise KernelConfigError(f"--attn-temperature-layers must be one of {', '.join(TEMPERATURE_LAYERS)}, "
                                    f"got {attn_temperature_layers!r}")
        if attn_temperature_floor_scale < 1:
            raise KernelConfigError(f"--attn-temperature-floor-scale must be >= 1, got {attn_temperature_floor_scale}")
        if not math.isfinite(attn_temperature_scale):
            raise KernelConfigError(f"--attn-temperature-scale must be a finite number, got {attn_temperature_scale}")
        self.floor_scale, self.beta = attn_temperature_floor_scale, float(attn_temperature_scale)

    def factor(self, positions: Tensor) -> Tensor:
        return 1.0 + self.beta * torch.log(torch.floor((positions + 1) / self.floor_scale) + 1)

    def extra_repr(self) -> str:
        return f"floor_scale={self.floor_scale}, scale={self.beta:g}"
