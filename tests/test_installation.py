"""The installed dependencies work together for what the plugin uses. fairseq requires torchaudio,
and the registry's newest torchaudio (2.11.0, a CUDA build) does not load beside torch 2.13.0's CPU
build; nothing fairseq imports for its tasks, models and criterions loads it, so only fairseq's
speech tasks, which the plugin does not use, would notice."""

import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow  # a fresh interpreter

EVERY_TASK_AND_CRITERION = """
import importlib, pkgutil, sys
import kerple_fairseq
import fairseq.criterions, fairseq.models, fairseq.tasks
for package in (fairseq.tasks, fairseq.criterions):
    for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(module.name)
assert "language_modeling" in fairseq.tasks.TASK_REGISTRY and "transformer_lm_kerple" in fairseq.models.ARCH_MODEL_REGISTRY
loaded = sorted(name for name in sys.modules if name.split(".")[0] == "torchaudio")
assert not loaded, loaded
"""


def test_every_fairseq_task_and_criterion_imports_without_loading_torchaudio():
    proc = subprocess.run([sys.executable, "-c", EVERY_TASK_AND_CRITERION], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
