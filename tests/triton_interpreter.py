"""Triton's interpreter (``TRITON_INTERPRET=1``: the fused backend's kernels on CPU tensors) without the two
scans it repeats, which take about a fifth of a fused test's time (Triton 3.8).

A launch (``GridExecutor.__call__``) swaps ``triton.language``'s builtins for interpreted ones for the
kernel's run and swaps them back after it. To find them it lists every member of four modules and classes
(``inspect.getmembers``), at every launch. And each call of a ``@triton.jit`` helper inside the kernel
(``InterpretedFunction.__call__``) swaps them again, keeping nothing of that second swap.

Here the builtins' names are listed once per module or class: a launch swaps each name whose member is still
a builtin, as Triton's own scan would. And a helper whose module is the running kernel's does not swap them
again: the launch already did it for the same modules (Triton's second swap finds their builtins swapped and
installs the same interpreted ``range``, casts and reductions again). A helper in another module still swaps as
Triton does. The kernels run the same operations either way; ``tests/test_fused_attention.py`` holds their
results to the explicit path with this in place."""

import inspect
import threading

from triton.language import core
from triton.runtime import interpreter

_running = threading.local()  # the module globals of the kernel this thread's launch is running
_builtin_names = {}  # by module or class: the names of its builtins


def _listed_builtins(pkg, builder, scope):
    names = _builtin_names.get(pkg)
    if names is None:
        names = _builtin_names[pkg] = [name for name, member in inspect.getmembers(pkg) if core.is_builtin(member)]
    for name in names:
        member = getattr(pkg, name)
        if core.is_builtin(member):
            interpreter._patch_attr(pkg, name, member, builder, scope)


def _launch(launch):
    def run(self, *args, **kwargs):
        outer, _running.globals = getattr(_running, "globals", None), self.fn.__globals__
        try:
            return launch(self, *args, **kwargs)
        finally:
            _running.globals = outer
    return run


def _helper_call(call):
    def run(self, *args, **kwargs):
        if getattr(_running, "globals", None) is not self.fn.__globals__:
            return call(self, *args, **kwargs)
        rewritten = self.rewrite()
        try:
            return rewritten(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e
    return run


def install():
    """Replace the interpreter's scans, where this Triton's interpreter has the functions named above."""
    needed = (interpreter, "_patch_builtin"), (interpreter, "_patch_attr"), (interpreter.GridExecutor, "__call__"), \
        (interpreter.InterpretedFunction, "__call__"), (interpreter.InterpretedFunction, "rewrite")
    if not all(hasattr(owner, name) for owner, name in needed):
        return
    interpreter._patch_builtin = _listed_builtins
    interpreter.GridExecutor.__call__ = _launch(interpreter.GridExecutor.__call__)
    interpreter.InterpretedFunction.__call__ = _helper_call(interpreter.InterpretedFunction.__call__)
