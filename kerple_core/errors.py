"""The core's one error type. It imports nothing; the plugin reports it as one line on the command line
(:mod:`kerple_fairseq.errors`)."""


class KernelConfigError(ValueError):
    """A bad kernel name, option value or model configuration.

    The message says what is wrong and what to do. Uncaught in a command of the plugin, it is printed as
    a single ``kerple_fairseq: error: ...`` line (exit status 1) instead of a traceback
    (:func:`kerple_fairseq.errors.install_one_line_errors`).
    """
