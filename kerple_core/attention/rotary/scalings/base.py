"""The interface of a rotary scaling, and its registry.

A scaling changes what rotary computes beyond the plain rotation (:mod:`..rotation`): the rotation's base
or its frequencies, the magnitude of the rotated queries and keys, what is done to each block of queries, or
the logits. Each is one module of this package with a :func:`register_rotary_scaling`-decorated
:class:`RotaryScaling` subclass. Its options are copied into the model's configuration as the kernels' are,
and the embedding holds them as attributes of the same names (``rotary.rerope_window``), where the scaling's
hooks read them: a scaling has no state of its own, and the embedding no parameters.

A scaling is chosen by ``--rotary-scaling NAME`` (one at a time, and settable on a trained model at
evaluation) or, with a ``switch``, by an option of its own (xPos's ``--rotary-xpos``).
"""

from typing import Callable, ClassVar, Dict, List, Optional, Type

from torch import Tensor

from kerple_core.errors import KernelConfigError
from kerple_core.kernels.registry import registrar

ROTARY_SCALING_CLASSES: Dict[str, Type["RotaryScaling"]] = {}


class RotaryScaling:
    """One scaling of rotary. Every hook is given the embedding (``rotary``: its head width, training
    length, options) and leaves the rotation unchanged unless the scaling overrides it."""

    name: ClassVar[str] = ""
    options: ClassVar[Optional[type]] = None
    #: the option of its own that turns it on; "": a choice of ``--rotary-scaling``
    switch: ClassVar[str] = ""
    #: scalings act, and ``--rotary-scaling`` lists its choices, in increasing precedence (ties: by name)
    precedence: ClassVar[int] = 0
    #: it does more than turn queries and keys (xPos's decay scales them)
    beyond_rotation: ClassVar[bool] = False
    #: it is defined on plain rotary only: refused with a scaling that goes ``beyond_rotation``
    plain_rotary_only: ClassVar[bool] = False
    #: it rewrites the logits (:meth:`logit_transform`): at most one such method per layer
    rewrites_logits: ClassVar[bool] = False

    @classmethod
    def command_line(cls) -> str:
        """The option that chooses it, as its messages name it."""
        return f"--{cls.switch.replace('_', '-')}" if cls.switch else f"--rotary-scaling {cls.name}"

    @classmethod
    def chosen(cls, options, scaling: str) -> bool:
        """It acts, given ``options`` (an embedding, or a model's arguments) and ``scaling``, the
        ``--rotary-scaling`` choice: its name is the choice, or its switch is on."""
        return bool(getattr(options, cls.switch, False)) if cls.switch else scaling == cls.name

    def check_options(self, rotary) -> None:
        """Refuse bad values of its options (every scaling's are checked, chosen or not)."""

    def check_training_length(self, rotary, train_length: int) -> None:
        """Refuse a training length it cannot work with (a ``--rotary-scaling`` choice)."""

    # -- the hooks
    def scale_factor(self, rotary) -> float:
        """``s`` of every position, as a ``--rotary-scaling`` choice: ``--rotary-scaling-length`` over the
        training length, at least 1 (0: ``s = 1``)."""
        return max(1.0, rotary.scaling_length / rotary.train_length)

    def base(self, rotary, base: float, s: float) -> float:
        """The rotation's base at scale ``s``."""
        return base

    def frequencies(self, rotary, theta: Tensor, s: float) -> Tensor:
        """The frequencies ``theta_k`` (float64 ``[D/2]``, of the base :meth:`base` gave) at scale ``s``."""
        return theta

    def magnitude(self, rotary, s: float) -> float:
        """A factor on the rotated queries and keys at scale ``s``."""
        return 1.0

    def band_starts(self, rotary, first_position: int, num_queries: int) -> List[int]:
        """The indices of the queries (at absolute positions ``first_position ..``) where a block of queries
        must start, those before and from it scaled differently."""
        return []

    def per_block(self, rotary, q: Tensor, k: Tensor, first_query: int, first_key: int):
        """One block's rotated queries ``[..., T, D]`` (at absolute positions ``first_query ..``) and keys
        ``[..., S, D]`` (at ``first_key ..``), changed as the block needs."""
        return q, k

    def logit_transform(self, rotary, q: Tensor, k: Tensor, first_query: int,
                        first_key: int) -> Optional[Callable[[Tensor, Tensor, Tensor], Tensor]]:
        """``(q, scores, mask) -> logits`` of one block of rotated queries and keys, for a scaling that
        rewrites the logits; None otherwise."""
        return None

    def describe(self, rotary) -> str:
        """What it adds to the embedding's ``repr``."""
        return f", {self.name} scaling (trained at {rotary.train_length})"


#: class decorator: make a :class:`RotaryScaling` available by its name
register_rotary_scaling = registrar(ROTARY_SCALING_CLASSES, RotaryScaling, "rotary scaling")


def by_precedence() -> List[Type[RotaryScaling]]:
    """Every registered scaling, in the order they act."""
    return sorted(ROTARY_SCALING_CLASSES.values(), key=lambda cls: (cls.precedence, cls.name))


def chosen_scalings(options, scaling: str) -> List[Type[RotaryScaling]]:
    """The scalings that act: those whose switch is on in ``options`` (an embedding, or a model's
    arguments) and the one named ``scaling`` (``--rotary-scaling``'s choice), in the order they act."""
    return [cls for cls in by_precedence() if cls.chosen(options, scaling)]


def check_together(scalings: List[Type[RotaryScaling]]) -> None:
    """The one rule of what composes among scalings, from what each declares: one defined on plain
    rotary only is refused beside one that goes beyond a rotation."""
    for plain in scalings:
        for beyond in scalings:
            if plain.plain_rotary_only and beyond.beyond_rotation:
                raise KernelConfigError(f"{plain.command_line()} is for plain rotary models, not with "
                                        f"{beyond.command_line()}")
