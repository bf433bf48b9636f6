"""kerple_core: positional attention biases and the attention that adds them, for any PyTorch model.

The distance kernels (:mod:`kerple_core.kernels`), the biases a layer builds for itself
(:mod:`kerple_core.layer_biases`), and attention with its backends and methods
(:mod:`kerple_core.attention`). Importing any of it changes nothing in the process: not ``argparse``,
``sys.excepthook``, fairseq, logging, the warnings filters or torch's compiler settings. fairseq, whose
option types the kernels declare their options with, is imported here with its import-time notices and
logging set-up kept out (:func:`kerple_core.quiet.imported_quietly`). The fairseq plugin beside it,
``kerple_fairseq``, makes its changes to fairseq when fairseq loads it for a run.
"""

from kerple_core.quiet import imported_quietly

with imported_quietly():
    import fairseq  # noqa: F401
