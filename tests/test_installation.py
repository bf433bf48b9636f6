"""The installed dependencies work together for what the plugin uses. fairseq requires torchaudio,
and the registry's newest torchaudio (2.11.0, a CUDA build) does not load beside torch 2.13.0's CPU
build; nothing fairseq imports for its tasks, models and criterions loads it, so only fairseq's
speech tasks, which the plugin does not use, would notice."""

import os
import subprocess
import sys
from pathlib import Path

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


SENTENCE_BATCHES = """
import numpy as np, torch
import kerple_fairseq  # as fairseq's commands load it (--user-dir)
from fairseq.data import TokenBlockDataset
sentences = [torch.tensor([5, 6, 2]), torch.tensor([7, 2]), torch.tensor([8, 9, 10, 2])]
for mode in ("eos", "complete", "complete_doc"):
    blocks = TokenBlockDataset(sentences, [3, 2, 4], block_size=8, pad=1, eos=2, break_mode=mode)
    assert sum(len(blocks[i]) for i in range(len(blocks))) == 9, mode
assert hasattr(np, "compat") == (np.__version__ < "2"), "NumPy itself is left as it is"
# a one-token first block: its past target is [pad, eos] and nothing of the block, as on NumPy 1
import warnings
warnings.simplefilter("error")  # NumPy 2's overflow warning of unsigned scalars
one = TokenBlockDataset([torch.tensor([5]), torch.tensor([7, 2])], np.array([1, 2], dtype=np.uint16), block_size=8,
                        pad=1, eos=2, break_mode="eos", include_targets=True)
source, target, past_target = one[0]
assert past_target.tolist() == [1, 2] and source.tolist() == [2] and target.tolist() == [5], past_target
"""


def test_fairseq_batches_by_sentence_with_the_installed_numpy():
    """fairseq 0.12 calls np.compat.long in these modes; NumPy 2 has none, and the plugin supplies it to
    fairseq's modules (kerple_fairseq/fairseq_changes.py), whichever NumPy is installed."""
    proc = subprocess.run([sys.executable, "-c", SENTENCE_BATCHES], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


def kernel_files_loaded(command, cwd):
    """The files of ``kerple_core.kernels.alibi`` (and any other copy of the package) that a
    command's Python loads, from ``python -v``'s record of each module's source."""
    proc = subprocess.run([sys.executable, "-v", *command], cwd=cwd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return sorted({os.path.realpath(line.split()[-1]) for line in proc.stderr.splitlines()
                   if line.startswith("# ") and line.rstrip().endswith(("kerple_core/kernels/alibi.py",
                                                                         "kerple_fairseq/__init__.py"))})


def test_every_command_runs_the_checkout(tmp_path):
    """The package is installed editable (scripts/setup-env.sh), so the console scripts and fairseq's
    ``--user-dir`` (a path, or ``kerple_fairseq`` from any directory) load the same files, this
    checkout's: an edit to a kernel is seen by every command at once. Run from outside the checkout,
    where a relative import cannot help."""
    import json
    import sysconfig
    from importlib import metadata

    # the environment's record (an egg-info folder in the checkout may also be on the path)
    site = sysconfig.get_paths()["purelib"]
    [record] = [d for d in metadata.distributions(path=[site]) if d.metadata["Name"] == "kerple-fairseq"]
    installed = json.loads(record.read_text("direct_url.json"))
    assert installed["dir_info"].get("editable") and installed["url"] == REPO.as_uri(), installed
    bin_dir = Path(sys.executable).parent
    expected = [str(REPO / "kerple_core" / "kernels" / "alibi.py"), str(REPO / "kerple_fairseq" / "__init__.py")]
    for command in ([str(bin_dir / "kerple-eval-lm"), "--help"], [str(bin_dir / "kerple-analyze"), "--help"],
                    *([str(bin_dir / "fairseq-train"), "--user-dir", user_dir, "--task", "language_modeling",
                       "--arch", "transformer_lm_kerple", "--help"] for user_dir in (str(REPO / "kerple_fairseq"),
                                                                                     "kerple_fairseq"))):
        assert kernel_files_loaded(command, tmp_path) == expected, command[0]
