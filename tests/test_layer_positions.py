"""Per-layer position plans (``--layer-positions``): each layer gets the encoding and window its entry
names, the machinery of the model-wide flags serves every layer (a plan of one entry is the model of
those flags), decoding equals full scoring, bad plans are one-line errors, and today's hybrid layouts
train through fairseq-train and evaluate at 32x."""

import math

import pytest
import torch

from kerple_core.attention.methods.attention_temperature import AttentionTemperature
from kerple_fairseq.analysis.kernel_curves import load_kernel
from kerple_fairseq.errors import KernelConfigError, UsageError
from kerple_fairseq.experiments.language_models import model_size_flags

from conftest import TRAIN_LENGTH, assert_finite_falling_loss, train_in_process
from helpers import tiny_model
from test_decoding_paths_of_newer_methods import beam_search_matches_full_scoring
from test_layer_biases import log_probs, tokens_of
from test_newer_methods_training import evaluate

#: RNoPE-SWA's layout (3 rotary sliding-window layers to 1 global NoPE layer), Llama 4's temperature in the
#: NoPE layer only, over six layers (the plan repeats)
HYBRID = "rotary@8,rotary@8,rotary@8,nope+attn_temperature"
LAYERS = ["--decoder-layers", "6"]


def hybrid(*flags):
    return tiny_model("kerple_log", *LAYERS, "--layer-positions", HYBRID, "--attn-temperature-floor-scale", "4",
                      *flags)


def test_each_layer_gets_the_encoding_and_window_of_its_entry():
    model = hybrid()
    named = [(a.setup.bias.attention_window, a.setup.rotary is not None, a.setup.bias.kernel.name,
              [type(m).__name__ for m in a.query_scales or ()])
             for a in (layer.self_attn for layer in model.decoder.layers)]
    rotary_window = (8, True, "none", [])
    nope_global = (0, False, "none", [AttentionTemperature.__name__])
    assert named == [rotary_window, rotary_window, rotary_window, nope_global, rotary_window, rotary_window]
    # one setup per entry, shared by its layers
    setups = [layer.self_attn.setup for layer in model.decoder.layers]
    assert setups[0] is setups[1] is setups[4] and setups[3] is not setups[0]


@pytest.mark.parametrize("layers, expected", [("nope", [False, False, False, True, False, False]),
                                               ("all", [True] * 6)])
def test_llama4_temperature_acts_in_the_nope_layers_unless_asked_for_everywhere(layers, expected):
    """Llama 4's iRoPE: rotary layers (here in a window) and global NoPE layers, the model-wide temperature in the
    NoPE layers only (transformers' Llama4TextAttention), or in every layer with --attn-temperature-layers all."""
    model = tiny_model("none", *LAYERS, "--layer-positions", "rotary@8,rotary@8,rotary@8,nope",
                       "--attn-temperature-tuning", "--attn-temperature-layers", layers)
    assert [any(isinstance(m, AttentionTemperature) for m in layer.self_attn.query_scales or ())
            for layer in model.decoder.layers] == expected
    assert [layer.self_attn.setup.rotary is None for layer in model.decoder.layers] == [
        False, False, False, True, False, False]


def test_a_gemma_layout_has_five_local_layers_to_one_global():
    model = tiny_model("none", "--decoder-layers", "12", "--layer-positions",
                       "rotary@8,rotary@8,rotary@8,rotary@8,rotary@8,rotary")
    assert [(a.setup.bias.attention_window, a.setup.rotary is not None)
            for a in (layer.self_attn for layer in model.decoder.layers)] == ([(8, True)] * 5 + [(0, True)]) * 2


def test_a_kernel_named_twice_is_one_module_and_in_the_checkpoint_under_each_bias():
    model = tiny_model("none", "--layer-positions", "alibi@4,alibi")
    biases = model.decoder.attention_biases
    assert len(biases) == 2 and biases[0].kernel is biases[1].kernel and biases[0].kernel.name == "alibi"
    assert [b.attention_window for b in biases] == [4, 0]
    assert not hasattr(model.decoder, "attention_bias")


@pytest.mark.parametrize("entry, flags", [
    ("alibi@6", ["--bias-kernel", "alibi", "--attn-window", "6"]),
    ("rotary+window@6", ["--bias-kernel", "window", "--rotary-embeddings", "--attn-window", "6"]),
    ("kerple_log+ssmax", ["--bias-kernel", "kerple_log", "--ssmax"]),
    ("fox", ["--bias-kernel", "fox"]),
])
def test_a_plan_of_one_entry_is_the_model_of_the_same_flags(entry, flags):
    torch.manual_seed(0)
    planned = tiny_model("none", "--layer-positions", entry).eval()
    plain = tiny_model(flags[1], *flags[2:]).eval()
    assert set(planned.state_dict()) == set(plain.state_dict())
    plain.load_state_dict(planned.state_dict())
    tokens = tokens_of()
    torch.testing.assert_close(log_probs(planned, tokens), log_probs(plain, tokens), rtol=0, atol=0)


def test_the_plan_changes_what_the_model_computes():
    torch.manual_seed(0)
    model = hybrid().eval()
    everywhere = tiny_model("none", *LAYERS, "--rotary-embeddings").eval()
    everywhere.load_state_dict(model.state_dict())
    tokens = tokens_of(length=30)
    assert (log_probs(model, tokens) - log_probs(everywhere, tokens)).abs().max() > 1e-3


def test_the_rotary_options_serve_the_plan_s_rotary_layers():
    model = tiny_model("none", "--layer-positions", "rotary,nope", "--rotary-xpos")
    assert [layer.self_attn.setup.rotary is not None and layer.self_attn.setup.rotary.xpos
            for layer in model.decoder.layers] == [True, False]


def test_decoding_blocks_and_beams_of_a_hybrid_equal_full_scoring():
    torch.manual_seed(0)
    model = hybrid().double().eval()
    tokens = tokens_of(length=30)
    full = log_probs(model, tokens)
    torch.testing.assert_close(log_probs(model, tokens, incremental=True), full, rtol=0, atol=1e-10)
    blocked = hybrid("--attention-block-size", "4").double().eval()
    blocked.load_state_dict(model.state_dict())
    torch.testing.assert_close(log_probs(blocked, tokens), full, rtol=0, atol=1e-10)
    beam_search_matches_full_scoring(hybrid().eval())


@pytest.mark.parametrize("plan, flags, message", [
    ("alibi+t5", [], "names two biases (alibi and t5); choose one per layer"),
    ("rotary+alibi", [], "alibi already encodes position; rotary goes with none or window only"),
    ("rotary@0", [], "the window after @ must be a whole number of keys >= 1"),
    ("nope,", [], "names no encoding: use nope for none"),
    ("rotray", [], "unknown position method 'rotray'; choose one of the bias kernels: alibi"),
    ("rotary", ["--rotary-embeddings"], "--layer-positions names each layer's encoding and window: drop "
                                        "--rotary-embeddings"),
    ("rotary", ["--attn-window", "4"], "drop --attn-window"),
    ("dape+cope", [], "--cope and --dape each rewrite the attention logits; choose one"),
    ("alibi,nope", ["--token-positional-embeddings"], "--bias-kernel alibi already encodes position, but token "
                                                      "positional embeddings are on"),
    ("nope,rotary", ["--token-positional-embeddings"], "--token-positional-embeddings and --rotary-embeddings are "
                                                       "two position encodings"),
    ("nope", ["--rotary-xpos"], "--rotary-xpos changes rotary embeddings"),
])
def test_bad_plans_are_one_line_errors(plan, flags, message):
    with pytest.raises(KernelConfigError, match=message.replace("+", r"\+").replace("(", r"\(").replace(")", r"\)")):
        tiny_model("none", "--layer-positions", plan, *flags)


def test_a_hybrid_trains_through_fairseq_train(data_bin, tmp_path):
    losses = train_in_process(data_bin, tmp_path, 40, "--arch", "transformer_lm_kerple", "--bias-kernel", "none",
                              "--layer-positions", "rotary@16,nope")
    assert_finite_falling_loss(losses, 40, "rotary@16,nope")
    state = torch.load(tmp_path / "checkpoint_last.pt", weights_only=True)
    assert state["cfg"]["model"]["layer_positions"] == "rotary@16,nope"
    # the kernel analyses say in one line that they do not draw a plan
    with pytest.raises(UsageError, match=r"each layer its own position encoding \(--layer-positions rotary@16,nope\)"):
        load_kernel(str(tmp_path / "checkpoint_last.pt"), "hybrid")


#: today's hybrid layouts, over four or six layers (the plan repeats): RNoPE-SWA (Yang et al. 2025: rotary layers in
#: a sliding window, one global NoPE layer in four), SWAN-GPT (the same, its scaling of the NoPE layer's queries
#: acting in evaluation only), Llama 4's iRoPE (rotary layers with chunked attention, one
#: global NoPE layer in four, the temperature in the NoPE layer only) and a Gemma-style 5:1 local/global rotary layout
LAYOUTS = {
    "rnope-swa": ["--decoder-layers", "4", "--layer-positions", "rotary@16,rotary@16,rotary@16,nope"],
    "swan": ["--decoder-layers", "4", "--layer-positions", "rotary@16,rotary@16,rotary@16,nope", "--swan-scaling"],
    "irope": ["--decoder-layers", "4", "--layer-positions", "rotary+chunked,rotary+chunked,rotary+chunked,nope",
              "--attn-chunk-size", "16", "--attn-temperature-tuning", "--attn-temperature-floor-scale", "64"],
    "gemma": ["--decoder-layers", "6", "--layer-positions",
              "rotary@16,rotary@16,rotary@16,rotary@16,rotary@16,rotary"],
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_each_layout_trains_through_fairseq_train_and_evaluates_at_32x(data_bin, tmp_path, layout):
    updates = 12
    flags = [*model_size_flags(layers=2, width=32, heads=4), *LAYOUTS[layout]]
    losses = train_in_process(data_bin, tmp_path, updates, "--arch", "transformer_lm_kerple", "--bias-kernel", "none",
                              *flags)
    assert_finite_falling_loss(losses, updates, layout)
    lengths = [TRAIN_LENGTH, 32 * TRAIN_LENGTH]
    records = evaluate(data_bin, tmp_path / "checkpoint_last.pt", tmp_path / "eval.json", lengths)
    assert {length for length, _ in records} == set(lengths)
    assert all(math.isfinite(r["ppl"]) for r in records.values())
    if layout == "swan":  # the scaling acts in evaluation: without it, the same checkpoint scores otherwise
        unscaled = evaluate(data_bin, tmp_path / "checkpoint_last.pt", tmp_path / "unscaled.json", lengths,
                            "--model-overrides", "{'swan_scaling': False}")
        assert all(unscaled[key]["ppl"] != records[key]["ppl"] for key in records)
