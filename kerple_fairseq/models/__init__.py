"""The plugin's fairseq models: ``transformer_lm`` with pluggable attention-bias kernels."""

from kerple_fairseq.models.transformer_lm_kerple import KernelBiasedLanguageModel  # noqa: F401
