"""Both halves of where the plugin's changes live: importing the core (kerple_core: kernels, attention,
layer biases) into a model of one's own changes nothing in the process, and fairseq loading the plugin
(kerple_fairseq) for a run makes the changes kerple_fairseq/fairseq_changes.py lists, and only those.

Each check runs in a fresh interpreter, which takes a snapshot of what a plugin could change (argparse's
error, ``sys.excepthook``, the root logger and every logger's level, the warnings filters, torch's
compiler and SDPA settings, and every attribute of fairseq's, Hydra's and argparse's modules and of their
classes), imports, and takes it again.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SNAPSHOT = r'''
import argparse, json, logging, pkgutil, sys, warnings
import torch, torch._dynamo


def process_settings():
    root = logging.getLogger()
    for name in ("fairseq", "fairseq.tasks.text_to_speech", "hydra"):  # those fairseq's import would set
        logging.getLogger(name)
    loggers = list(logging.Logger.manager.loggerDict.items())
    return {
        "argparse.ArgumentParser.error": repr(argparse.ArgumentParser.error),
        "sys.excepthook": repr(sys.excepthook),
        "root logger": [repr(h) for h in root.handlers] + [root.level],
        "logger levels": {n: lg.level for n, lg in loggers if isinstance(lg, logging.Logger)},
        "warnings filters": [repr(f) for f in warnings.filters],
        "dynamo config": repr(sorted(torch._dynamo.config.get_config_copy().items())),
        "sdpa": [torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
                 torch.backends.cuda.math_sdp_enabled()],
        "torch": [str(torch.get_default_dtype()), torch.are_deterministic_algorithms_enabled(),
                  torch.get_num_threads(), repr(torch.load), repr(torch.save)],
    }


def module_attributes():
    """Each attribute of fairseq's, fairseq_cli's, Hydra's and argparse's loaded modules and of the
    classes they define, as the identity of the object it holds."""
    held = {}
    for name, module in list(sys.modules.items()):
        if module is None or name.split(".")[0] not in ("fairseq", "fairseq_cli", "hydra", "argparse"):
            continue
        for attribute, value in list(vars(module).items()):
            held[f"{name}.{attribute}"] = id(value)
            if isinstance(value, type) and value.__module__ == name:
                for member, inner in list(vars(value).items()):
                    held[f"{name}.{attribute}.{member}"] = id(inner)
    return held


def snapshot(fairseq_too):
    return {"process": process_settings(), "modules": module_attributes() if fairseq_too else {}}


def every_module(package):
    module = __import__(package, fromlist=["_"])
    names = [package] + [m.name for m in pkgutil.walk_packages(module.__path__, package + ".")]
    for name in names:
        __import__(name)
    return names
'''


def run_in_a_fresh_interpreter(body: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", SNAPSHOT + body], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def differences(before: dict, after: dict) -> list:
    """What differs: a setting, the level of a logger that existed before (a library imported later may
    set its own loggers' levels), an attribute's object."""
    after = dict(after, process=dict(after["process"], **{"logger levels": {
        name: level for name, level in after["process"]["logger levels"].items()
        if name in before["process"]["logger levels"]}}))
    changed = [key for key in before["process"] if before["process"][key] != after["process"][key]]
    changed += [name for name, held in before["modules"].items() if after["modules"].get(name) != held]
    return sorted(changed)


def test_importing_the_core_first_changes_nothing_in_the_process():
    """The core imported before anything else: argparse, sys.excepthook, logging (no handler on the root
    logger, so a later basicConfig works), the warnings filters, torch's settings stay; and nothing is
    printed (fairseq's import-time notices kept out)."""
    proc = subprocess.run([sys.executable, "-c", SNAPSHOT + (
        "before = snapshot(False)\n"
        "names = every_module('kerple_core')\n"
        "after = snapshot(False)\n"
        "print(json.dumps({'before': before, 'after': after, 'modules': names}))\n")],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr == ""  # no warning, no log line
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert differences(found["before"], found["after"]) == []
    assert not found["after"]["process"]["root logger"][:-1]
    assert {"kerple_core.kernels.alibi", "kerple_core.attention.attend", "kerple_core.attention.blocks",
            "kerple_core.attention.flex", "kerple_core.layer_biases.fire"} <= set(found["modules"])
    assert not any(name.startswith("kerple_fairseq") for name in found["modules"])


def test_the_core_beside_fairseq_changes_none_of_fairseqs_modules_and_the_plugin_makes_its_listed_changes():
    """fairseq imported first (as a model of one's own might): the core changes none of its modules'
    attributes nor the process's settings, and does not load the plugin. Then the plugin, imported as
    fairseq imports it for ``--user-dir``, makes its changes: argparse's error, sys.excepthook, fairseq's
    checkpoint loader, the warnings filters; every change it lists is made."""
    found = run_in_a_fresh_interpreter(
        "import fairseq, fairseq.checkpoint_utils, fairseq_cli.train, fairseq_cli.eval_lm\n"
        "first = snapshot(True)\n"
        "every_module('kerple_core')\n"
        "with_core = snapshot(True)\n"
        "plugin_loaded = 'kerple_fairseq' in sys.modules\n"
        "import kerple_fairseq\n"
        "from kerple_fairseq.fairseq_changes import CHANGES\n"
        "with_plugin = snapshot(True)\n"
        "print(json.dumps({'first': first, 'with_core': with_core, 'with_plugin': with_plugin,\n"
        "                  'plugin_loaded': plugin_loaded, 'changes': len(CHANGES)}))\n")
    assert differences(found["first"], found["with_core"]) == []
    assert not found["plugin_loaded"]
    changed = differences(found["with_core"], found["with_plugin"])
    for expected in ("argparse.ArgumentParser.error", "sys.excepthook", "warnings filters",
                     "fairseq.checkpoint_utils.load_checkpoint_to_cpu"):
        assert expected in changed, changed
    for unchanged in ("dynamo config", "sdpa", "torch", "root logger"):
        assert unchanged not in changed


def test_every_change_the_plugin_makes_is_listed_with_why():
    from kerple_fairseq.fairseq_changes import CHANGES, SWAPS_DURING_BUILD

    assert all(change.why.strip() and callable(change.make) for change in CHANGES)
    assert all(swap.why.strip() for swap in SWAPS_DURING_BUILD)


def test_the_build_swaps_are_those_listed_and_fairseqs_names_are_back_after(monkeypatch):
    """Building a plugin model points exactly the names of SWAPS_DURING_BUILD at the plugin's classes,
    and each is fairseq's own again when the build ends."""
    import importlib

    from fairseq.models import transformer_lm
    from fairseq.modules import transformer_layer

    from kerple_fairseq.fairseq_changes import SWAPS_DURING_BUILD
    from kerple_fairseq.models import decoder, transformer_lm_kerple
    from tests.helpers import tiny_model

    stock = {(swap.module, swap.name): getattr(importlib.import_module(swap.module), swap.name)
             for swap in SWAPS_DURING_BUILD}
    swapped = set()
    replaced = decoder.replaced

    def recording(module, name, value):
        swapped.add((module.__name__, name))
        return replaced(module, name, value)

    monkeypatch.setattr(decoder, "replaced", recording)
    monkeypatch.setattr(transformer_lm_kerple, "replaced", recording)
    tiny_model("alibi")
    assert swapped == set(stock)
    assert transformer_lm.TransformerDecoder is stock[("fairseq.models.transformer_lm", "TransformerDecoder")]
    assert transformer_layer.TransformerDecoderLayerBase is \
        stock[("fairseq.modules.transformer_layer", "TransformerDecoderLayerBase")]


@pytest.mark.parametrize("how", ["compiled", "eager"])
def test_flex_attention_leaves_torchs_compiler_settings_as_they_were(how, monkeypatch):
    """FlexAttention's higher limit of compiles holds during its own calls only."""
    import torch

    from kerple_core.attention import flex
    from kerple_core.visibility import GLOBAL

    if not flex.available():
        pytest.fail("this torch has no FlexAttention")
    monkeypatch.setattr(flex, "COMPILED", how == "compiled")
    before = torch._dynamo.config.get_config_copy()
    q = torch.randn(1, 2, 8, 16)
    mask = flex.block_mask(GLOBAL, 8, 8, 0, 0, q.device)
    flex.attend(q, q, q, flex.distance_bias(torch.zeros(2, 8), torch.zeros(1, dtype=torch.long)), mask)
    assert torch._dynamo.config.get_config_copy() == before
