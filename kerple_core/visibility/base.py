"""Which keys each query sees, said once per layer.

The query at absolute position ``i`` sees the key at position ``j`` if ``f(i) <= j <= i`` (and ``j`` is
not padding), where ``f(i)``, the first key it sees, is the latest of ``0``, ``i - w + 1`` under an
attention window of ``w`` keys, and each rule's first key (a chunk's start). So what a query sees is
contiguous and ends at the query, and ``f`` never decreases along positions; every backend takes what it
needs from ``f``: FlexAttention the tiles it skips or takes whole and the cells it masks inside the
others, the explicit path and SDPA their ``-inf`` cells, blocks of queries the first key they read, SSMax
the number of keys each query sees (``i - f(i) + 1``). A window depends on the distance ``i - j`` alone,
so the distance bias lays it out with its per-distance values; a rule (:class:`VisibilityRule`) may
depend on the positions themselves.

Incremental decoding with ``cache = w`` keeps the last ``w`` keys (``--max-cache-window``, Sandwich App.
B): a new query then sees as under a window of ``w``, which is also what the methods that count the keys
a query sees are told.
"""

import dataclasses
from typing import Callable, ClassVar, Dict, List, Optional, Tuple, Type

import torch
from torch import Tensor

from kerple_core.errors import KernelConfigError
from kerple_core.kernels.registry import declared_fields, options_from, registrar

VISIBILITY_RULES: Dict[str, Type["VisibilityRule"]] = {}

#: ``positions -> first key positions`` (int64, any shape), over tensors captured when it was made
FirstKey = Callable[[Tensor], Tensor]


class VisibilityRule:
    """A rule of which keys a query sees beyond causality: the first key position each query position
    sees (:meth:`first_key`), never after the query and never decreasing along positions. A subclass
    sets ``options`` to a dataclass of its command-line options (fields become ``--dashed-flags``) and
    takes them as keyword arguments."""

    name: ClassVar[str] = ""
    options: ClassVar[Optional[type]] = None
    #: a rule tells no positions apart by itself: rotary embeddings or token positions go with it
    encodes_position: ClassVar[bool] = False

    def constants(self) -> Dict[str, int]:
        """The whole numbers :meth:`first_key` reads, by name."""
        return {}

    @staticmethod
    def first_key(positions, **constants):
        """The first key position seen from each of ``positions`` (ints, or int64 tensors of any shape),
        given :meth:`constants` (ints, or 0-d tensors that FlexAttention's compiler reads inside its
        kernel): written once with operations that take both."""
        raise NotImplementedError

    def describe(self) -> str:
        """A few words for figure titles and ``repr``."""
        return self.name


register_visibility_rule = registrar(VISIBILITY_RULES, VisibilityRule, "visibility rule")


def build_visibility_rule(name: str, cfg=None) -> VisibilityRule:
    """Visibility rule ``name`` with its options from ``cfg`` (missing or None: the dataclass default)."""
    if name not in VISIBILITY_RULES:
        raise KernelConfigError(f"unknown visibility rule {name!r}; choose one of: {', '.join(sorted(VISIBILITY_RULES))}")
    cls = VISIBILITY_RULES[name]
    return cls(**options_from(cls.options, cfg))


def visibility_rule_option_fields() -> List[dataclasses.Field]:
    """Every option field declared by a registered visibility rule, each once."""
    return declared_fields(VISIBILITY_RULES[name] for name in sorted(VISIBILITY_RULES))


@dataclasses.dataclass(frozen=True)
class Visibility:
    """Which keys each query of a layer sees: causality, the attention window (``window`` keys, 0: none),
    the rules (``rules``), and in incremental decoding the cache of the last ``cache`` keys (0: all)."""

    window: int = 0
    rules: Tuple[VisibilityRule, ...] = ()
    cache: int = 0

    def __post_init__(self):
        if self.window < 0:
            raise KernelConfigError(f"--attn-window must be >= 0 (0: no window), got {self.window}")

    @property
    def by_position(self) -> bool:
        """Some rule depends on the positions themselves, not only on their distance."""
        return bool(self.rules)

    @property
    def keys_counted(self) -> int:
        """The most keys a query sees by distance alone (0: every key before it): the window or the cache's."""
        limits = [w for w in (self.window, self.cache) if w]
        return min(limits) if limits else 0

    def first_key(self, device) -> FirstKey:
        """``f``: the first key position each query position sees (:data:`FirstKey`), over its numbers as
        one-element tensors made here on ``device`` (never Python numbers, which FlexAttention's CPU
        compiler mishandles)."""
        window = torch.full((1,), self.window, dtype=torch.int64, device=device)
        rules = [(rule, {name: torch.full((1,), value, dtype=torch.int64, device=device)
                         for name, value in rule.constants().items()}) for rule in self.rules]

        def first(positions: Tensor) -> Tensor:
            found = positions - window[0] + 1 if self.window else torch.zeros_like(positions)
            for rule, constants in rules:
                found = torch.maximum(found, rule.first_key(positions, **{k: v[0] for k, v in constants.items()}))
            return found.clamp(min=0)
        return first

    def first_key_at(self, position: int) -> int:
        """``f(position)`` on the host, for a block's first key (no tensor: nothing waits for a device)."""
        found = [position - self.window + 1 if self.window else 0]
        found += [rule.first_key(position, **rule.constants()) for rule in self.rules]
        return max(0, *found)

    def keys_seen(self, first_position: int, num_queries: int, device) -> Tensor:
        """``[queries]`` float64: how many keys the queries at positions ``first_position ..`` see, at most
        the cache's ``w`` (``i - f(i) + 1``)."""
        positions = torch.arange(first_position, first_position + num_queries, device=device)
        counts = (positions - self.first_key(device)(positions) + 1).to(torch.float64)
        return counts.clamp(max=self.cache) if self.cache else counts

    def seen(self, first_query: int, num_queries: int, first_key: int, num_keys: int, device) -> Tensor:
        """``[queries, keys]`` bool: which of the keys at positions ``first_key ..`` each query at positions
        ``first_query ..`` sees (causality included)."""
        queries = torch.arange(first_query, first_query + num_queries, device=device)
        keys = torch.arange(first_key, first_key + num_keys, device=device)
        return (keys[None, :] <= queries[:, None]) & (keys[None, :] >= self.first_key(device)(queries)[:, None])

    def extra_repr(self) -> str:
        parts = ([f"window={self.window}"] if self.window else []) + [rule.describe() for rule in self.rules]
        return ", ".join(parts + ([f"cache={self.cache}"] if self.cache else []))


#: every key before the query
GLOBAL = Visibility()
