"""How fairseq trains the plugin's models across processes and machines: the launch (torchrun, CPU
processes, timeouts) and what survives an interruption (checkpoint copies, the data position).

Importing this package changes nothing in fairseq: :func:`~kerple_fairseq.fairseq_changes.apply_all`
calls :func:`~kerple_fairseq.training.distributed.install_distributed` and
:func:`~kerple_fairseq.training.resume.install_resume` when the plugin is imported, so ``fairseq-train
--user-dir kerple_fairseq`` and ``fairseq-hydra-train`` get them without further options;
:func:`install_training_fixes` makes both.
"""

from kerple_fairseq.training.distributed import install_distributed
from kerple_fairseq.training.resume import install_resume


def install_training_fixes() -> None:
    install_distributed()
    install_resume()


__all__ = ["install_training_fixes"]
