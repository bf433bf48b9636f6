"""Why a model extrapolates: its kernel curves, effective lengths, position-wise perplexity and
empirical receptive field, computed from checkpoints (``kerple-analyze``)."""
