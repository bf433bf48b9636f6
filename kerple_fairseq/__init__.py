"""kerple_fairseq: a fairseq ``--user-dir`` plugin of positional attention-bias kernels.

Importing the package registers the ``kerple_lm`` model and its architectures
(``transformer_lm_kerple``, ``transformer_lm_alibi``, ``transformer_lm_rotary``,
each also as ``..._wiki103``) and every kernel in :mod:`kerple_fairseq.kernels`.
"""

import os

from kerple_fairseq.quiet import logging_left_to_the_process, silence_library_notices

silence_library_notices()  # before fairseq is imported: its import-time notices are among them
with logging_left_to_the_process():
    import fairseq  # noqa: F401
    from fairseq import models as _fairseq_models, tasks as _fairseq_tasks  # noqa: F401  (all their modules)

from kerple_fairseq.errors import KernelConfigError  # noqa: E402
from kerple_fairseq import kernels, models  # noqa: F401,E402  (registration)
from kerple_fairseq.fairseq_changes import apply_all  # noqa: E402


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
