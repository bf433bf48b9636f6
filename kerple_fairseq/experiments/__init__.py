"""The repository's experiments as a library; ``scripts/*.py`` are their command lines.

- :mod:`~kerple_fairseq.experiments.paths`: this checkout's plugin folder and scripts, and the fairseq commands
- :mod:`~kerple_fairseq.experiments.wikitext103`: download, verify, unpack and preprocess WikiText-103
- :mod:`~kerple_fairseq.experiments.language_models`: the fairseq flags of a model size; building a model in-process
- :mod:`~kerple_fairseq.experiments.recipe`: ALiBi's WikiText-103 recipe, its tiny CPU preset, small CPU runs,
  and fairseq-train command lines for GPUs or gloo CPU processes
- :mod:`~kerple_fairseq.experiments.comparison`: train models, evaluate them at several lengths, tabulate
- :mod:`~kerple_fairseq.experiments.small_comparison`: the small offline ALiBi vs KERPLE-log comparison on CPU
- :mod:`~kerple_fairseq.experiments.reproduction`: KERPLE's Table 10 (ALiBi vs KERPLE-log on WikiText-103)
- :mod:`~kerple_fairseq.experiments.benchmark`: time and memory of the bias kernels against no bias
- :mod:`~kerple_fairseq.experiments.logit_precision`: how exactly each attention backend forms the biased
  logits in fp16 and bf16
They run from a checkout of the repository: the pipelines start its ``scripts/``. The GPU checks'
deployment tooling (the offline bundle, the bounded command) is ``gpu_tools/`` beside the package.
"""
