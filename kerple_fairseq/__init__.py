"""kerple_fairseq: a fairseq ``--user-dir`` plugin of positional attention-bias kernels.

fairseq imports it when it loads the plugin for a run (``--user-dir kerple_fairseq``, the hub's
``user_dir=``; the plugin's own commands import it too). Importing it registers the ``kerple_lm`` model
and its architectures (``transformer_lm_kerple``, ``transformer_lm_alibi``, ``transformer_lm_rotary``,
each also as ``..._wiki103``) and makes every change to fairseq listed in
:mod:`kerple_fairseq.fairseq_changes`. The kernels, layer biases and attention it builds its models from
are the core beside it, :mod:`kerple_core`, which a model of one's own can import with no such change.
"""

import os

import kerple_core.kernels  # noqa: F401  (the kernels' registry; fairseq imported quietly by the core)
from kerple_fairseq import models, tasks  # noqa: F401  (registration)
from kerple_fairseq.errors import KernelConfigError
from kerple_fairseq.fairseq_changes import apply_all


def _register_fairseq_user_dir_alias() -> None:
    # fairseq's import_user_module resolves `--user-dir kerple_fairseq` outside the repo to
    # <site-packages>/fairseq/../kerple_fairseq and refuses it as "not globally unique" unless
    # that spelling is in __path__. Record the spellings that name this very directory.
    import fairseq

    here = os.path.dirname(os.path.abspath(__file__))
    alias = os.path.join(os.path.dirname(fairseq.__file__), "..", os.path.basename(here))
    if os.path.exists(alias) and os.path.samefile(alias, here) and alias not in __path__:
        __path__.append(alias)


_register_fairseq_user_dir_alias()
apply_all()  # every change to fairseq, listed in kerple_fairseq/fairseq_changes.py

__all__ = ["KernelConfigError"]
