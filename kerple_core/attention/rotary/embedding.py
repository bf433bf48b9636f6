"""A layer's rotary embedding: RoPE's rotation (:mod:`.rotation`) with the scalings its options choose
(:mod:`.scalings`), applied to queries and keys inside self-attention. No parameters: checkpoints are
unchanged by it."""

import dataclasses
from dataclasses import dataclass, field
from typing import List, Tuple

from fairseq.dataclass import ChoiceEnum
from torch import Tensor, nn

from kerple_core.attention.rotary.rotation import ROTARY_BASE, frequencies, rotate
from kerple_core.attention.rotary.scalings import (
    ROTARY_SCALING_CLASSES,
    RotaryScaling,
    by_precedence,
    check_together,
    chosen_scalings,
)
from kerple_core.errors import KernelConfigError
from kerple_core.kernels.registry import declared_fields, options_from

#: ``--rotary-scaling``'s choices: the scalings chosen by name, set at training or on a trained model at evaluation
ROTARY_SCALINGS = ("none", *(cls.name for cls in by_precedence() if not cls.switch))
#: the choices that rewrite the logits (ReRoPE's)
RE_ROPE = tuple(cls.name for cls in by_precedence() if not cls.switch and cls.rewrites_logits)


@dataclass
class RotaryOptions:
    rotary_scaling: ChoiceEnum(list(ROTARY_SCALINGS)) = field(default="none", metadata={
        "help": "scale rotary beyond the training length (--tokens-per-sample), by s = "
        "--rotary-scaling-length / training length: ntk (base b s^(D/(D-2))), yarn (frequencies "
        "ramped to theta/s, logits times (0.1 ln s + 1)^2); dynamic-ntk: ntk with s from the "
        "length each query has reached (in bands of --dynamic-ntk-step); rerope: relative "
        "positions from --rerope-window w on seen as w (leaky-rerope: w + (i - j - w) / "
        "--rerope-leak); at evaluation: kerple-eval-lm --rotary-scaling, or --model-overrides"})
    rotary_scaling_length: int = field(default=0, metadata={
        "help": "the length L_eval of s = L_eval / training length for ntk and "
        "yarn (kerple-eval-lm sets it per evaluated length); 0: s = 1"})


class RotaryEmbedding(nn.Module):
    """RoPE on queries and keys, changed by the scalings chosen: the one ``--rotary-scaling`` names
    (:attr:`scaling`, which :meth:`set_scaling` changes) and those on by options of their own.

    ``cfg`` holds the options (missing or None: their defaults), which the embedding keeps as attributes of
    the same names; every scaling's are checked, chosen or not, so that any may be set at evaluation.
    ``train_length`` is the training length the scalings extend."""

    options = RotaryOptions

    def __init__(self, head_dim: int, cfg=None, train_length: int = 0):
        super().__init__()
        if head_dim % 2:
            raise KernelConfigError(f"rotary embeddings need an even head dimension, got {head_dim}")
        self.head_dim = head_dim
        self.scalings = [cls() for cls in by_precedence()]
        for scaling in self.scalings:
            for name, value in options_from(scaling.options, cfg).items():
                setattr(self, name, value)
        for scaling in self.scalings:
            scaling.check_options(self)
        own = options_from(RotaryOptions, cfg)
        self.set_scaling(str(own["rotary_scaling"]), train_length, own["rotary_scaling_length"])

    def set_scaling(self, scaling: str, train_length: int, scaling_length: int = 0) -> None:
        """Scale the rotation for lengths beyond ``train_length`` (also on a trained model, at
        evaluation) by the scaling named ``scaling``; ``ntk`` and ``yarn`` by
        ``s = max(1, scaling_length / train_length)`` (0: ``s = 1``)."""
        if scaling not in ROTARY_SCALINGS:
            raise KernelConfigError(f"unknown --rotary-scaling {scaling!r}; choose one of: {', '.join(ROTARY_SCALINGS)}")
        if scaling != "none" and train_length < 1:
            raise KernelConfigError(f"--rotary-scaling {scaling} needs the training length (--tokens-per-sample)")
        if scaling_length < 0:
            raise KernelConfigError(f"--rotary-scaling-length must be >= 0, got {scaling_length}")
        check_together(chosen_scalings(self, scaling))
        if scaling != "none":
            self._named(scaling).check_training_length(self, train_length)
        self.scaling, self.train_length, self.scaling_length = scaling, train_length, scaling_length

    def acting(self) -> List[RotaryScaling]:
        """The scalings that act, in the order they act."""
        return [s for s in self.scalings if s.chosen(self, self.scaling)]

    def scale_factor(self) -> float:
        """``s`` of every position: 1 without a ``--rotary-scaling`` choice, else the choice's."""
        if self.scaling == "none":
            return 1.0
        return self._named(self.scaling).scale_factor(self)

    def _named(self, name: str) -> RotaryScaling:
        return next(scaling for scaling in self.scalings if scaling.name == name)

    def inverse_frequencies(self, s: float, device=None) -> Tensor:
        """``theta_k`` of each pair ``k`` at scale ``s``, float64 ``[D/2]``: ``b^(-2k/D)`` of the base the
        scalings give, then as the scalings change them."""
        acting = self.acting()
        base = ROTARY_BASE
        for scaling in acting:
            base = scaling.base(self, base, s)
        theta = frequencies(self.head_dim, base, device)
        for scaling in acting:
            theta = scaling.frequencies(self, theta, s)
        return theta

    def magnitude(self, s: float) -> float:
        """The factor of the rotated queries and keys at scale ``s`` (YaRN's); 1 otherwise."""
        factor = 1.0
        for scaling in self.acting():
            factor *= scaling.magnitude(self, s)
        return factor

    def forward(self, *xs: Tensor, offset: int = 0) -> Tuple[Tensor, ...]:
        """Rotate each ``x`` (``[..., T, head_dim]``, e.g. queries and keys), whose rows sit at
        positions ``offset .. offset + T - 1``; the angles are computed once for all of them."""
        s = self.scale_factor()
        return tuple(rotate(x, offset, self.inverse_frequencies(s, x.device), self.magnitude(s)) for x in xs)

    def band_starts(self, first_position: int, num_queries: int) -> List[int]:
        """The indices of the queries (at absolute positions ``first_position ..``) where blocks of queries
        start, each block scaled as one (dynamic NTK's bands)."""
        return sorted({start for scaling in self.acting()
                       for start in scaling.band_starts(self, first_position, num_queries)})

    def per_block(self, q: Tensor, k: Tensor, first_query: int, first_key: int) -> Tuple[Tensor, Tensor]:
        """One block's rotated queries ``[..., T, D]`` (at absolute positions ``first_query ..``) and keys
        ``[..., S, D]`` (at ``first_key ..``) with what depends on the block (dynamic NTK's rotation at the
        block's scale, xPos's decay); unchanged without such a scaling."""
        for scaling in self.acting():
            q, k = scaling.per_block(self, q, k, first_query, first_key)
        return q, k

    def logit_transform(self, q: Tensor, k: Tensor, first_query: int, first_key: int):
        """The score transform ``(q, scores, mask) -> logits`` of one block of rotated queries (at absolute
        positions ``first_query ..``) and keys (at ``first_key ..``) of a scaling that rewrites the logits
        (ReRoPE's); None without one."""
        for scaling in self.acting():
            transform = scaling.logit_transform(self, q, k, first_query, first_key)
            if transform is not None:
                return transform
        return None

    # read by name by the model's users
    @property
    def xpos(self) -> bool:
        """xPos's decay acts."""
        return bool(self.rotary_xpos)

    def rerope_window_size(self) -> int:
        """ReRoPE's window ``w``: --rerope-window, or a quarter of the training length."""
        return ROTARY_SCALING_CLASSES["rerope"].window(self)

    def extra_repr(self) -> str:
        # the scalings of options of their own first, then the --rotary-scaling choice
        described = sorted(self.acting(), key=lambda scaling: not scaling.switch)
        return f"head_dim={self.head_dim}" + "".join(scaling.describe(self) for scaling in described)


def rotary_option_fields() -> List[dataclasses.Field]:
    """Every rotary option, each once, in the order of ``--help``: those of the scalings chosen by options of
    their own, ``--rotary-scaling``'s, then those of its choices."""
    classes = by_precedence()
    return declared_fields([cls for cls in classes if cls.switch] + [RotaryEmbedding] +
                           [cls for cls in classes if not cls.switch])
