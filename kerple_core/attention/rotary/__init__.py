"""Rotary position embeddings: RoPE's rotation (:mod:`.rotation`), its scalings, one module each
(:mod:`.scalings`), and the embedding a layer applies (:mod:`.embedding`)."""

from kerple_core.attention.rotary.embedding import (
    RE_ROPE,
    ROTARY_SCALINGS,
    RotaryEmbedding,
    rotary_option_fields,
)

__all__ = ["RE_ROPE", "ROTARY_SCALINGS", "RotaryEmbedding", "rotary_option_fields"]
