"""What a module keeps while its parameters are frozen (evaluation, generation), and how it knows the
parameters have not changed without reading their values.

Reading the values (``tolist``, ``item``) as a cache key would copy them to the host at every forward,
which on a GPU waits for the device. The key here is each tensor's identity and version counter, which
PyTorch increments at every in-place write to the tensor or to a view of it (``load_state_dict``'s copy,
``p.add_(...)`` under ``no_grad``), and which lives on the host. Writes through ``.data`` leave no trace
in it: those are an optimiser's, made in training mode, and a module of this kind drops what it keeps
whenever it enters or leaves training (``train``, ``eval``: fairseq does so around every step and every
validation) and when it is moved or cast.
"""

from typing import Iterable, Tuple

from torch import Tensor, nn


def versions(tensors: Iterable[Tensor]) -> Tuple[Tuple[int, int], ...]:
    """``(identity, version)`` of each tensor: equal while no tensor has been written in place."""
    return tuple((id(t), t._version) for t in tensors)


class KeepsWhileFrozen(nn.Module):
    """A module that keeps results computed from its parameters while they are frozen; it says how to drop
    them (:meth:`drop_kept`), and they are dropped on entering or leaving training and on a move or cast."""

    def drop_kept(self) -> None:
        raise NotImplementedError

    def frozen_key(self) -> Tuple[Tuple[int, int], ...]:
        """Equal while none of the module's parameters and buffers has been written in place."""
        return versions([*self.parameters(), *self.buffers()])

    def train(self, mode: bool = True):
        self.drop_kept()
        return super().train(mode)

    def _apply(self, fn, *args, **kwargs):
        self.drop_kept()
        return super()._apply(fn, *args, **kwargs)
