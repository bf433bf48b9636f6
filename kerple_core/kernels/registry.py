"""Name -> kernel class registry, and the command-line options the kernels declare."""

import dataclasses
from typing import Dict, Iterable, List, Optional, Type

from kerple_core.errors import KernelConfigError
from kerple_core.kernels.base import BiasKernel

KERNELS: Dict[str, Type[BiasKernel]] = {}
#: the metadata key of an option added with a behaviour other than the one before it: the value that keeps
#: that earlier behaviour, which checkpoints saved before the option existed get
#: (:func:`kerple_fairseq.evaluation.checkpoint_file.with_saved_behaviour`)
SAVED_BEFORE = "saved_before"


def registrar(table: Dict[str, type], base: type, what: str):
    """A class decorator factory: ``@registrar(...)(name)`` names a ``base`` subclass and enters it in
    ``table``; ``what`` names such classes in errors."""

    def register(name: str):
        def wrap(cls):
            if name in table:
                raise ValueError(f"{what} {name!r} is registered twice")
            if not issubclass(cls, base):
                raise TypeError(f"{cls.__name__} must subclass {base.__name__}")
            cls.name = name
            table[name] = cls
            return cls

        return wrap

    return register


#: class decorator: make a :class:`BiasKernel` available as ``--bias-kernel NAME``
register_kernel = registrar(KERNELS, BiasKernel, "bias kernel")


def kernel_names() -> List[str]:
    return sorted(KERNELS)


def build_kernel(name: str, num_heads: int, cfg=None, head_dim: Optional[int] = None) -> BiasKernel:
    """Instantiate kernel ``name`` for ``num_heads`` heads, reading its options from ``cfg``.

    Options missing from ``cfg`` (or ``None`` there) take the option dataclass's default. A kernel
    that ``needs_head_dim`` gets ``head_dim``, by default ``cfg``'s ``decoder_embed_dim / num_heads``.
    """
    if name not in KERNELS:
        raise KernelConfigError(
            f"unknown bias kernel {name!r}; choose one of: {', '.join(kernel_names())}"
        )
    cls = KERNELS[name]
    kwargs = options_from(cls.options, cfg)
    if cls.needs_head_dim:
        if head_dim is None and getattr(cfg, "decoder_embed_dim", None) is not None:
            head_dim = cfg.decoder_embed_dim // num_heads
        if head_dim is None:
            raise KernelConfigError(f"bias kernel {name!r} needs the width of an attention head")
        kwargs["head_dim"] = head_dim
    return cls(num_heads, **kwargs)


def options_from(options: Optional[type], cfg) -> Dict[str, object]:
    """The constructor arguments for the ``options`` dataclass's fields, read from ``cfg``; a field
    missing from ``cfg`` (or None there) takes its default."""
    kwargs = {}
    for f in dataclasses.fields(options) if options else ():
        value = getattr(cfg, f.name, None) if cfg is not None else None
        kwargs[f.name] = f.default if value is None else value
    return kwargs


def declared_fields(classes: Iterable[type]) -> List[dataclasses.Field]:
    """Every field of the ``options`` dataclasses of ``classes``, each once, in their order."""
    seen: Dict[str, dataclasses.Field] = {}
    for cls in classes:
        for f in dataclasses.fields(cls.options) if cls.options else ():
            # classes may share one options dataclass, but not declare one flag twice
            if seen.setdefault(f.name, f) is not f:
                raise ValueError(f"option {f.name!r} is declared by two options dataclasses")
    return list(seen.values())


def option_fields() -> List[dataclasses.Field]:
    """Every option field declared by a registered kernel, each once, in a stable order."""
    return declared_fields(KERNELS[name] for name in kernel_names())
