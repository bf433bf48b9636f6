"""The cost of a new attention method, visibility rule, rotary scaling or attention backend: one module of its own. A toy written into a
copy of the core and the plugin, and no other file changed, is found in fairseq-train's options, the model's configuration
(the comparison's table and the benchmark's models for a method), and trains."""

import shutil
import sys
import textwrap

import pytest

from conftest import REPO, run

TOY_METHOD = '''
"""A toy attention method: every query times a learned gain per head."""

from dataclasses import dataclass, field

import torch
from torch import nn

from kerple_core.attention.methods.base import QUERIES, AttentionMethod, register_attention_method


@dataclass
class ToyGainOptions:
    toy_gain: bool = field(default=False, metadata={"help": "toy: each query times a learned gain"})
    toy_gain_init: float = field(default=2.0, metadata={"help": "toy: the initial gain"})


@register_attention_method("toy_gain")
class ToyGain(AttentionMethod):
    options = ToyGainOptions
    switch = "toy_gain"
    acts_on = QUERIES

    def __init__(self, num_heads, head_dim, toy_gain=True, toy_gain_init=2.0):
        super().__init__()
        self.gain = nn.Parameter(torch.full((num_heads,), float(toy_gain_init)))

    def scale_queries(self, q, first_position, keys_seen):
        return q * self.gain.to(q.dtype)[:, None, None]
'''

#: what every check script starts with: the copied packages are the ones imported, and ``parsed`` gives
#: fairseq-train's arguments for a tiny model of the given model flags (2 updates on CPU into ``save_dir``)
PREAMBLE = '''
import sys
from pathlib import Path

import torch

import kerple_core
import kerple_fairseq
assert Path(kerple_fairseq.__file__).parent == Path(sys.argv[1]), kerple_fairseq.__file__
assert Path(kerple_core.__file__).parent == Path(sys.argv[1]).parent / "kerple_core", kerple_core.__file__
from fairseq import options
from fairseq.checkpoint_utils import load_model_ensemble
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq_cli.train import main

from kerple_fairseq.models.config import KernelBiasedLMConfig

data_bin, save_dir = sys.argv[2], sys.argv[3]


def parsed(*model_flags):
    return options.parse_args_and_arch(options.get_training_parser(), [
        data_bin, "--user-dir", sys.argv[1], "--task", "language_modeling", *model_flags, "--decoder-layers", "2",
        "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "4",
        "--tokens-per-sample", "32", "--max-tokens", "256", "--optimizer", "adam", "--lr", "0.001", "--cpu",
        "--max-update", "2", "--num-workers", "0", "--disable-validation", "--no-epoch-checkpoints",
        "--save-dir", save_dir, "--distributed-world-size", "1"])
'''

CHECKS = '''
from kerple_fairseq.experiments.benchmark import ADDED_METHODS
from kerple_fairseq.experiments.position_encodings import position_encoding

encoding = position_encoding("toy_gain")
assert encoding.model_flags() == ["--arch", "transformer_lm_kerple", "--bias-kernel", "none", "--toy-gain"]
assert ADDED_METHODS["toy-gain"] == ["--toy-gain"]
assert "toy_gain_init" in KernelBiasedLMConfig.__dataclass_fields__
args = parsed(*encoding.model_flags(), "--toy-gain-init", "3")
assert args.toy_gain is True and args.toy_gain_init == 3.0
main(convert_namespace_to_omegaconf(args))
state = torch.load(Path(save_dir) / "checkpoint_last.pt", weights_only=True)
gains = [state["model"][f"decoder.layers.{n}.self_attn.query_scales.0.gain"] for n in range(2)]
assert all(g.shape == (4,) and torch.isfinite(g).all() and not torch.equal(g, torch.full((4,), 3.0)) for g in gains)
print("toy_gain trained", [g.tolist() for g in gains])
'''


TOY_RULE = '''
"""A toy visibility rule: each query sees the keys of its own stretch of positions and of the one before."""

from dataclasses import dataclass, field

from kerple_core.visibility.base import VisibilityRule, register_visibility_rule


@dataclass
class ToyStretchesOptions:
    toy_stretch: int = field(default=4, metadata={"help": "toy: positions per stretch"})


@register_visibility_rule("toy_stretches")
class ToyStretches(VisibilityRule):
    """f(i) = s (floor(i / s) - 1): the query's stretch of s positions and the one before."""

    options = ToyStretchesOptions

    def __init__(self, toy_stretch=4):
        self.stretch = toy_stretch

    def constants(self):
        return {"stretch": self.stretch}

    @staticmethod
    def first_key(positions, stretch):
        return (positions // stretch - 1) * stretch
'''

RULE_CHECKS = '''
from kerple_fairseq.experiments.position_encodings import position_encoding

encoding = position_encoding("toy_stretches")
assert encoding.model_flags() == ["--arch", "transformer_lm_kerple", "--bias-kernel", "toy_stretches"]
assert "toy_stretch" in KernelBiasedLMConfig.__dataclass_fields__
main(convert_namespace_to_omegaconf(parsed(*encoding.model_flags(), "--toy-stretch", "3")))
[model], _ = load_model_ensemble([str(Path(save_dir) / "checkpoint_last.pt")])
visibility = model.decoder.layers[0].self_attn.setup.visibility
assert [type(rule).name for rule in visibility.rules] == ["toy_stretches"] and visibility.rules[0].stretch == 3
# stretches of 3: the query at 10 sees keys 6 to 10, the one at 2 keys 0 to 2
seen = visibility.seen(0, 21, 0, 21, "cpu")
assert seen[10].nonzero().flatten().tolist() == list(range(6, 11)) and seen[2].nonzero().flatten().tolist() == [0, 1, 2]
print("toy_stretches trained")
'''


TOY_SCALING = '''
"""A toy rotary scaling: every frequency divided by a fixed factor (linear position interpolation)."""

from dataclasses import dataclass, field

from kerple_core.attention.rotary.scalings.base import RotaryScaling, register_rotary_scaling


@dataclass
class ToyStretchOptions:
    toy_rotary_divisor: float = field(default=2.0, metadata={"help": "toy: every rotary frequency over this"})


@register_rotary_scaling("toy-stretch")
class ToyStretch(RotaryScaling):
    options = ToyStretchOptions

    def frequencies(self, rotary, theta, s):
        return theta / rotary.toy_rotary_divisor
'''

SCALING_CHECKS = '''
from kerple_core.attention.rotary import ROTARY_SCALINGS, RotaryEmbedding
from kerple_fairseq.evaluation.cli import build_parser

assert "toy-stretch" in ROTARY_SCALINGS and "toy_rotary_divisor" in KernelBiasedLMConfig.__dataclass_fields__
assert "toy-stretch" in next(a.choices for a in build_parser()._actions if "--rotary-scaling" in a.option_strings)
args = parsed("--arch", "transformer_lm_rotary", "--rotary-scaling", "toy-stretch", "--toy-rotary-divisor", "4")
assert args.rotary_scaling == "toy-stretch" and args.toy_rotary_divisor == 4.0
main(convert_namespace_to_omegaconf(args))
[model], _ = load_model_ensemble([str(Path(save_dir) / "checkpoint_last.pt")])
rotary = model.decoder.layers[0].self_attn.setup.rotary
plain = RotaryEmbedding(rotary.head_dim).inverse_frequencies(1.0)
assert rotary.scaling == "toy-stretch" and torch.equal(rotary.inverse_frequencies(1.0), plain / 4)
print("toy-stretch trained")
'''


TOY_BACKEND = '''
"""A toy attention backend: softmax(q k^T + B) v in float64, for float64 blocks (and any block, asked for by name)."""

import torch

from kerple_core.attention.backends.base import AttentionBackend, register_backend

#: whether it runs on this machine (a check turns it off to see the refusal)
RUNS = True
#: the blocks it attended
ATTENDED = []


@register_backend("toy_float64")
class ToyFloat64(AttentionBackend):
    summary = "toy: softmax(q k^T + B) v in float64"
    comes_before = "sdpa"

    def unavailable(self, device):
        return None if RUNS else "--attention-backend toy_float64 is off on this machine: choose --attention-backend auto"

    def takes(self, call):
        serves = (call.returns_values_only and call.key_padding_mask is None and not call.bias.has_weight
                  and call.dropout == 0.0)
        return serves and (call.asked is self or call.q.dtype == torch.float64)

    def attend(self, call):
        ATTENDED.append(call.q.shape)
        q, k, v = (x.double() for x in (call.q, call.k, call.v))
        logits = q @ k.transpose(-1, -2) + call.bias.mask(torch.float64, q.device)
        return (torch.softmax(logits, -1) @ v).to(call.q.dtype), None
'''

BACKEND_CHECKS = '''
import pytest

from kerple_core.attention import attend
from kerple_core.attention.backends import BACKENDS, toy_float64
from kerple_core.attention.blocks import QueryBlock
from kerple_core.attention.self_attention import recorded
from kerple_fairseq.errors import KernelConfigError
from kerple_fairseq.models.decoder import attention_backend

assert list(BACKENDS) == ["explicit", "fused", "flex", "kernel gradient", "toy_float64", "sdpa"], list(BACKENDS)
assert attend.BACKENDS == ("auto", "explicit", "fused", "flex", "toy_float64", "sdpa"), attend.BACKENDS
parser = options.get_training_parser()
args = options.parse_args_and_arch(parser, [data_bin, "--user-dir", sys.argv[1], "--task", "language_modeling",
                                            "--arch", "transformer_lm_alibi", "--attention-backend", "toy_float64"])
assert args.attention_backend == "toy_float64" and "toy_float64: toy: softmax" in parser.format_help()

# auto takes it where it serves (float64 blocks, before sdpa), not elsewhere; asked for, it takes every block it serves
main(convert_namespace_to_omegaconf(parsed("--arch", "transformer_lm_alibi", "--attention-dropout", "0")))
[model], _ = load_model_ensemble([str(Path(save_dir) / "checkpoint_last.pt")])
model.eval()
tokens = torch.randint(4, 100, (2, 24))
with torch.no_grad():
    expected = model(tokens)[0]
    with recorded(model) as record:
        assert torch.equal(model(tokens)[0], expected)
    assert set(record.backends) == {"sdpa"}, record.backends
    bias = model.decoder.setup.bias.for_block(QueryBlock(0, 24, 0, 24, 0), 24, shared=False)
    q = torch.randn(1, 4, 24, 8, dtype=torch.float64)
    choose = dict(dropout=0.0, key_padding_mask=None, need_probabilities=False)
    assert attend.choose_backend(q, q, bias, **choose) == "toy_float64"
    assert attend.choose_backend(q.float(), q.float(), bias, **choose) == "sdpa"
    assert attend.choose_backend(q.float(), q.float(), bias, preference="toy_float64", **choose) == "toy_float64"
    assert attend.choose_backend(q, q, bias, need_probabilities=True, dropout=0.0, key_padding_mask=None) == "explicit"
    out, _ = attend.attend(q, q, q, bias)
    reference, _ = attend.attend(q, q, q, bias, preference="explicit")
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-12)
    model.decoder.setup.backend = "toy_float64"
    with recorded(model) as record:
        torch.testing.assert_close(model(tokens)[0], expected, rtol=0, atol=1e-5)
    assert set(record.backends) == {"toy_float64"}, record.backends

# trains when asked for
args = parsed("--arch", "transformer_lm_alibi", "--attention-dropout", "0", "--attention-backend", "toy_float64")
args.save_dir = save_dir + "-toy"
toy_float64.ATTENDED.clear()
main(convert_namespace_to_omegaconf(args))
assert len(toy_float64.ATTENDED) == 2 * 2, "two layers, two updates: every block by the toy"
state = torch.load(Path(args.save_dir) / "checkpoint_last.pt", weights_only=True)
assert state["cfg"]["model"]["attention_backend"] == "toy_float64" and state["optimizer_history"][-1]["num_updates"] == 2

# refused in one line where it cannot run, before anything is built
toy_float64.RUNS = False
with pytest.raises(KernelConfigError) as refused:
    attention_backend(args)
assert str(refused.value) == "--attention-backend toy_float64 is off on this machine: choose --attention-backend auto"
print("toy_float64 chosen")
'''


def copy_with(tmp_path, folder, name, source):
    """The core and the plugin copied into ``tmp_path``, with module ``name`` of ``source`` written into the
    core's ``folder`` and no other file changed; the copied plugin's folder."""
    for package in ("kerple_core", "kerple_fairseq"):
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "kerple_core" / folder / f"{name}.py").write_text(textwrap.dedent(source))
    return tmp_path / "kerple_fairseq"


def run_checks(tmp_path, package, checks, data_bin):
    script = tmp_path / "checks.py"
    script.write_text(PREAMBLE + checks)
    return run([sys.executable, script, package, data_bin, tmp_path / "run"], cwd=tmp_path,
               env={"PYTHONPATH": str(tmp_path), "PATH": ""})


@pytest.mark.slow
def test_a_method_in_a_module_of_its_own_is_everywhere(data_bin, tmp_path):
    package = copy_with(tmp_path, "attention/methods", "toy_gain", TOY_METHOD)
    assert "toy_gain trained" in run_checks(tmp_path, package, CHECKS, data_bin).stdout


@pytest.mark.slow
def test_a_visibility_rule_in_a_module_of_its_own_is_everywhere(data_bin, tmp_path):
    """A chunk-like rule of which keys a query sees, one file: an option of fairseq-train, a model of the
    comparison's table, and a model that trains."""
    package = copy_with(tmp_path, "visibility", "toy_stretches", TOY_RULE)
    assert "toy_stretches trained" in run_checks(tmp_path, package, RULE_CHECKS, data_bin).stdout


@pytest.mark.slow
def test_a_rotary_scaling_in_a_module_of_its_own_is_everywhere(data_bin, tmp_path):
    """A position-interpolation-like scaling, one file: a choice of --rotary-scaling for fairseq-train and
    kerple-eval-lm, its option in the model's configuration, and a model that trains with it."""
    package = copy_with(tmp_path, "attention/rotary/scalings", "toy_stretch", TOY_SCALING)
    assert "toy-stretch trained" in run_checks(tmp_path, package, SCALING_CHECKS, data_bin).stdout


@pytest.mark.slow
def test_an_attention_backend_in_a_module_of_its_own_is_everywhere(data_bin, tmp_path):
    """A backend, one file: in auto's order where it says, chosen by auto where it serves and not elsewhere, asked
    for by name (a choice of --attention-backend, in its help), equal to the explicit path, training a model, and
    refused in one line where it cannot run."""
    package = copy_with(tmp_path, "attention/backends", "toy_float64", TOY_BACKEND)
    assert "toy_float64 chosen" in run_checks(tmp_path, package, BACKEND_CHECKS, data_bin).stdout


def test_the_docs_list_the_backends_of_the_registry():
    """README's --attention-backend choices, design.md's list of backends (in auto's order, each with its file) and
    its option table are the registry's."""
    import re

    from kerple_core.attention.backends import BACKENDS, choices

    readme = (REPO / "README.md").read_text()
    assert f"`--attention-backend {{{','.join(choices())}}}`" in readme
    design = (REPO / "docs" / "design.md").read_text()
    section = design[design.index("**`attend.py` and `backends/`: how a block is attended.**"):]
    section = section[:section.index("\n\n", section.index("\n- **"))]
    listed = re.findall(r"^- \*\*([^*]+)\*\* \(`backends/(\w+)\.py`", section, re.M)
    assert [name for name, _ in listed] == list(BACKENDS), listed
    for name, module in listed:
        assert type(BACKENDS[name]).__module__ == f"kerple_core.attention.backends.{module}", (name, module)
    row = next(line for line in design.splitlines() if line.startswith("| `--attention-backend` |"))
    assert all(f"`{name}`" in row for name in choices()), row
