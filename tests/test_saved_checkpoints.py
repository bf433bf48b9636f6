"""Checkpoints of every position encoding, saved by kerple_fairseq at commit 862e066 (see
tests/data/saved-checkpoints/README.md), load with the current code and score as they did then:
full scoring, the rotary checkpoint under each evaluation-time scaling, and incremental decoding
token by token (the key and value cache of generation). Each model keeps the parameter names it
was saved with."""

from functools import lru_cache
from pathlib import Path

import pytest
import torch
from fairseq import checkpoint_utils

import kerple_fairseq  # noqa: F401  (registers the architectures the checkpoints name)

SAVED = Path(__file__).parent / "data" / "saved-checkpoints"
#: every checkpoint the folder must hold: a missing or an unexpected file fails
CHECKPOINTS = [
    # the position encodings that are trained (kerple_fairseq.experiments.position_encodings)
    "sinusoidal", "rotary", "nope", "t5", "alibi", "kerple_log", "fire", "fox", "dape_alibi", "dape_kerple_log",
    "xpos", "cope", "stick_breaking", "selective", "ssmax",
    # and further combinations
    "dape_conv_kerple_log", "rotary_temperature", "alibi_window16", "fox_bias_only", "rotary_window16",
    "kerple_bias_wht",
]
#: the rotary checkpoint's evaluation-time methods: the model options set when it is loaded
ROTARY_OVERRIDES = {
    "ntk": {"rotary_scaling": "ntk", "rotary_scaling_length": 96},
    "dynamic-ntk": {"rotary_scaling": "dynamic-ntk"},
    "yarn": {"rotary_scaling": "yarn", "rotary_scaling_length": 96},
    "rerope": {"rotary_scaling": "rerope"},
    "leaky-rerope": {"rotary_scaling": "leaky-rerope"},
}
#: float32 products round differently from one CPU to another (by about 2e-6 here)
TOLERANCE = dict(rtol=0, atol=1e-5)


def saved_names():
    return sorted(p.name[: -len(".pt")] for p in SAVED.glob("*.pt") if not p.name.endswith(".log-probs.pt"))


CASES = [(name, None) for name in saved_names()] + [("rotary", v) for v in ROTARY_OVERRIDES]


def case_id(case):
    name, variant = case
    return name if variant is None else f"{name}@{variant}"


@lru_cache(maxsize=None)
def model_of(name, variant):
    """The checkpoint loaded by fairseq (its dictionary from the folder), in eval mode."""
    overrides = {"data": str(SAVED), **(ROTARY_OVERRIDES[variant] if variant else {})}
    models, _, _ = checkpoint_utils.load_model_ensemble_and_task([str(SAVED / f"{name}.pt")],
                                                                 arg_overrides=overrides)
    return models[0].eval()


@lru_cache(maxsize=None)
def saved_scores(name):
    return torch.load(SAVED / f"{name}.log-probs.pt", weights_only=True)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These models are tiny: threads only wait on one another (several times slower on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def key(variant, what):
    return what if variant is None else f"{variant}/{what}"


def test_the_folder_holds_every_checkpoint_and_its_scores():
    assert saved_names() == sorted(CHECKPOINTS)
    scores = sorted(p.name[: -len(".log-probs.pt")] for p in SAVED.glob("*.log-probs.pt"))
    assert scores == sorted(CHECKPOINTS)
    assert (SAVED / "dict.txt").is_file()
    rotary = saved_scores("rotary")
    assert {k.split("/")[0] for k in rotary if "/" in k} == set(ROTARY_OVERRIDES)


@pytest.mark.parametrize("name", saved_names())
def test_the_model_has_the_parameter_names_it_was_saved_with(name):
    saved = torch.load(SAVED / f"{name}.pt", weights_only=True)["model"]
    assert sorted(model_of(name, None).state_dict()) == sorted(saved)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_full_scoring_gives_the_saved_log_probabilities(case):
    name, variant = case
    saved = saved_scores(name)
    with torch.no_grad():
        log_probs = torch.log_softmax(model_of(name, variant)(saved["tokens"])[0].float(), -1)
    torch.testing.assert_close(log_probs, saved[key(variant, "log_probs")], **TOLERANCE)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_incremental_decoding_gives_the_saved_log_probabilities(case):
    """The model called one token at a time with an incremental state, as fairseq's
    SequenceGenerator calls it, gives each next token the log-probability it gave at 862e066, and
    every step's whole distribution equals the saved full scoring (as it did then, to 3e-6)."""
    name, variant = case
    saved = saved_scores(name)
    tokens, model = saved["tokens"], model_of(name, variant)
    state, steps = {}, []
    with torch.no_grad():
        for end in range(1, tokens.size(1) + 1):
            steps.append(torch.log_softmax(model(tokens[:, :end], incremental_state=state)[0].float(), -1))
    decoded = torch.cat(steps, dim=1)
    next_tokens = decoded[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
    torch.testing.assert_close(next_tokens, saved[key(variant, "incremental_token_log_probs")], **TOLERANCE)
    torch.testing.assert_close(decoded, saved[key(variant, "log_probs")], **TOLERANCE)


def test_options_added_since_keep_the_behaviour_the_checkpoints_were_saved_with():
    """These checkpoints predate --ssmax-scope, --rerope-query-scale and --attn-temperature-layers: each gets the
    value of the behaviour it was trained with (read by fairseq or as data), an override of it is honoured, and a
    configuration that has the option keeps its value. (--cpu-attention-block-scores, which changes no result,
    gets its default: below.)"""
    from kerple_core.attention.blocks import CPU_BLOCK_SCORES
    from kerple_fairseq.evaluation.checkpoint_file import as_fairseq_state, read_checkpoint, with_saved_behaviour
    from kerple_fairseq.models.config import KernelBiasedLMConfig, saved_before

    assert saved_before() == {"ssmax_scope": "queries", "rerope_query_scale": "none", "attn_temperature_layers": "all",
                              "cpu_attention_block_scores": CPU_BLOCK_SCORES}
    defaults = KernelBiasedLMConfig()
    assert (defaults.ssmax_scope, defaults.rerope_query_scale, defaults.attn_temperature_layers) == ("logits", "log",
                                                                                                      "nope")
    assert all(layer.self_attn.query_scales for layer in model_of("rotary_temperature", None).decoder.layers)
    state = as_fairseq_state(read_checkpoint(str(SAVED / "rotary_temperature.pt")))
    assert {k: state["cfg"].model[k] for k in saved_before()} == saved_before()
    overridden = as_fairseq_state(read_checkpoint(str(SAVED / "rotary.pt")), {"rerope_query_scale": "log"})
    assert overridden["cfg"].model.rerope_query_scale == "log"
    recent = {"cfg": {"model": {"bias_kernel": "none", "ssmax_scope": "logits"}}}
    assert with_saved_behaviour(recent)["cfg"]["model"]["ssmax_scope"] == "logits"


def test_an_override_of_an_option_added_since_is_honoured():
    """The rotary checkpoint under ReRoPE with the reference's query scale (the default of models trained now)
    scores differently from the saved, unscaled ReRoPE beyond the training length, and the same within it."""
    saved = saved_scores("rotary")
    overrides = {"data": str(SAVED), **ROTARY_OVERRIDES["rerope"], "rerope_query_scale": "log"}
    models, _, _ = checkpoint_utils.load_model_ensemble_and_task([str(SAVED / "rotary.pt")], arg_overrides=overrides)
    model = models[0].eval()
    assert model.decoder.setup.rotary.rerope_query_scale == "log"
    train_length = model.decoder.setup.rotary.train_length
    with torch.no_grad():
        log_probs = torch.log_softmax(model(saved["tokens"])[0].float(), -1)
    unscaled = saved["rerope/log_probs"]
    assert saved["tokens"].size(1) > train_length + 1
    torch.testing.assert_close(log_probs[:, :train_length], unscaled[:, :train_length], **TOLERANCE)
    assert (log_probs[:, train_length + 1:] - unscaled[:, train_length + 1:]).abs().max() > 1e-3


def test_a_checkpoint_saved_before_the_cpu_block_option_takes_its_default():
    """``--cpu-attention-block-scores`` is newer than the saved checkpoints: their configuration lacks it,
    the loaded model cuts blocks on a CPU as a new one does, and a model override of it is taken."""
    from kerple_core.attention.blocks import CPU_BLOCK_SCORES

    saved = torch.load(SAVED / "dape_alibi.pt", map_location="cpu", weights_only=True)["cfg"]["model"]
    assert "cpu_attention_block_scores" not in saved and saved["attention_block_size"] == 1024
    assert model_of("dape_alibi", None).decoder.setup.cpu_block_scores == CPU_BLOCK_SCORES
    overridden, _, _ = checkpoint_utils.load_model_ensemble_and_task(
        [str(SAVED / "dape_alibi.pt")], arg_overrides={"data": str(SAVED), "cpu_attention_block_scores": 0})
    assert overridden[0].decoder.setup.cpu_block_scores == 0
