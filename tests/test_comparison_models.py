"""The models of one comparison differ only in their position encoding: built with the comparison's
flags, every architecture and kernel gives the same parameters (names, shapes), norm placement,
embedding scale and dropouts, apart from the position parameters themselves."""

import pytest
import torch
from fairseq import models as fairseq_models, options
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.models.transformer_lm import TransformerLanguageModel

from kerple_fairseq.experiments import small_comparison
from kerple_fairseq.experiments.position_encodings import POSITION_ENCODINGS as COMPARED, position_encoding
from kerple_fairseq.experiments.language_models import DictionaryTask, build_model, model_size_flags, parse_model_flags

#: every way the plugin encodes position, by name: its flags
POSITION_ENCODINGS = {
    "sinusoidal": ["--arch", "transformer_lm_sinusoidal{size}"],
    "learned": ["--arch", "transformer_lm_learned_pos{size}"],
    "rotary": ["--arch", "transformer_lm_rotary{size}"],
    "nope": ["--arch", "transformer_lm_kerple{size}", "--bias-kernel", "none"],
    "t5": ["--arch", "transformer_lm_kerple{size}", "--bias-kernel", "t5"],
    "alibi": ["--arch", "transformer_lm_alibi{size}"],
    "kerple_log": ["--arch", "transformer_lm_kerple{size}"],
    "fire": ["--arch", "transformer_lm_kerple{size}", "--bias-kernel", "fire"],
    "fox": ["--arch", "transformer_lm_kerple{size}", "--bias-kernel", "fox"],
    "dape_alibi": ["--arch", "transformer_lm_alibi{size}", "--dape", "mlp"],
    "dape_kerple_log": ["--arch", "transformer_lm_kerple{size}", "--dape", "mlp"],
    "rotary_ntk": ["--arch", "transformer_lm_rotary{size}"],
    "rotary_dynamic_ntk": ["--arch", "transformer_lm_rotary{size}"],
    "rotary_yarn": ["--arch", "transformer_lm_rotary{size}"],
    "xpos": ["--arch", "transformer_lm_rotary{size}", "--rotary-xpos"],
    "cope": ["--arch", "transformer_lm_cope{size}"],
    "stick_breaking": ["--arch", "transformer_lm_kerple{size}", "--bias-kernel", "none", "--stick-breaking"],
    "selective": ["--arch", "transformer_lm_kerple{size}", "--bias-kernel", "none", "--selective-attention"],
    "ssmax": ["--arch", "transformer_lm_rotary{size}", "--ssmax"],
    "rotary_rerope": ["--arch", "transformer_lm_rotary{size}"],
    "rotary_leaky_rerope": ["--arch", "transformer_lm_rotary{size}"],
    "rotary_rerope_unscaled": ["--arch", "transformer_lm_rotary{size}"],
    "p_rope": ["--arch", "transformer_lm_rotary{size}", "--rotary-fraction", "0.25"],
    "bam_ssmax": ["--arch", "transformer_lm_kerple{size}", "--bias-kernel", "bam", "--ssmax", "--ssmax-scale-init", "1"],
    "bam_ssmax_queries": ["--arch", "transformer_lm_kerple{size}", "--bias-kernel", "bam", "--ssmax",
                          "--ssmax-scale-init", "1", "--ssmax-scope", "queries"],
    "bam": ["--arch", "transformer_lm_kerple{size}", "--bias-kernel", "bam"],
    "rnope_swa": ["--arch", "transformer_lm_kerple{size}", "--bias-kernel", "none", "--layer-positions", "rotary@16,nope"],
    "swan": ["--arch", "transformer_lm_kerple{size}", "--bias-kernel", "none", "--layer-positions", "rotary@16,nope"],
    "irope": ["--arch", "transformer_lm_kerple{size}", "--bias-kernel", "none", "--layer-positions", "rotary+chunked,nope",
              "--attn-chunk-size", "16", "--attn-temperature-tuning", "--attn-temperature-floor-scale", "16"],
    "gemma": ["--arch", "transformer_lm_kerple{size}", "--bias-kernel", "none", "--layer-positions", "rotary@16,rotary"],
    "path": ["--arch", "transformer_lm_kerple{size}", "--bias-kernel", "none", "--path-attention"],
}
#: what a model is evaluated with on top (the same trained model)
EVALUATED_WITH = {"rotary_ntk": ("--rotary-scaling", "ntk"), "rotary_dynamic_ntk": ("--rotary-scaling", "dynamic-ntk"),
                  "rotary_yarn": ("--rotary-scaling", "yarn"),
                  "rotary_rerope": ("--rotary-scaling", "rerope", "--model-overrides", "{'rerope_query_scale': 'log'}"),
                  "rotary_leaky_rerope": ("--rotary-scaling", "leaky-rerope", "--model-overrides",
                                          "{'rerope_query_scale': 'log'}"),
                  "rotary_rerope_unscaled": ("--rotary-scaling", "rerope", "--model-overrides",
                                             "{'rerope_query_scale': 'none'}"),
                  "swan": ("--model-overrides", "{'swan_scaling': True}")}
POSITION_PARAMETERS = ("embed_positions.", "attention_bias.kernel.", "self_attn.layer_bias.", "self_attn.score_transform.",
                       "self_attn.query_scales.")


def build(name, size, flags, task):
    """Position encoding ``name`` on the architecture of ``size`` ("": transformer_lm's, "_wiki103": ALiBi's)."""
    return build_model(parse_model_flags([*(f.format(size=size) for f in POSITION_ENCODINGS[name]), *flags]), task)


def signature(model):
    """Everything of the model that a position encoding must not change."""
    layers = model.decoder.layers
    return {
        "parameters": [(n, tuple(p.shape)) for n, p in model.named_parameters()
                       if not any(k in n for k in POSITION_PARAMETERS)],
        "normalize_before": [layer.normalize_before for layer in layers],
        "final_layer_norm": model.decoder.layer_norm is not None,
        "embed_scale": model.decoder.embed_scale,
        "dropout": [model.decoder.dropout_module.p] + [layer.dropout_module.p for layer in layers],
        "attention_dropout": [layer.self_attn.dropout_module.p for layer in layers],
        "adaptive_softmax": model.decoder.adaptive_softmax is not None,
    }


def position_parameters(model):
    return sum(p.numel() for n, p in model.named_parameters() if any(k in n for k in POSITION_PARAMETERS))


def assert_differ_only_in_position(models):
    signatures = {name: signature(model) for name, model in models.items()}
    first = next(iter(signatures))
    for name, sig in signatures.items():
        for key in sig:
            assert sig[key] == signatures[first][key], f"{name} and {first} differ in {key}"
    heads = models["alibi"].decoder.layers[0].self_attn.num_heads
    encoded = {name: position_parameters(model) for name, model in models.items()}
    assert encoded["nope"] == encoded["alibi"] == encoded["rotary"] == encoded["sinusoidal"] == 0
    assert encoded["rotary_ntk"] == encoded["rotary_dynamic_ntk"] == encoded["rotary_yarn"] == encoded["xpos"] == 0
    assert encoded["kerple_log"] == 2 * heads and encoded["t5"] == 32 * heads and encoded["learned"] > 0
    layers, width = len(models["alibi"].decoder.layers), models["alibi"].decoder.embed_dim
    # per layer: FIRE's Linear(1, 32), Linear(32, H), c and m; FoX's Linear(E, H); DAPE's Linear(2H, 32), Linear(32, H)
    assert encoded["fire"] == layers * (2 * 32 + 32 * heads + heads + 2)
    assert encoded["fox"] == layers * (width * heads + heads)
    dape = layers * (2 * heads * 32 + 32 + 32 * heads + heads)
    assert encoded["dape_alibi"] == dape and encoded["dape_kerple_log"] == dape + 2 * heads
    # per layer: CoPE's table [head dim, --tokens-per-sample + 1]
    tokens = models["alibi"].decoder.max_target_positions
    assert encoded["cope"] == layers * (width // heads) * (tokens + 1)
    assert encoded["stick_breaking"] == encoded["selective"] == encoded["rotary_rerope"] == 0
    assert encoded["ssmax"] == layers * heads  # one scale per head and layer
    assert encoded["p_rope"] == encoded["rotary_rerope_unscaled"] == 0
    # BAM's shape, scale and location per head, once per model; SSMax's scale per head and layer
    assert encoded["bam_ssmax"] == encoded["bam_ssmax_queries"] == 3 * heads + layers * heads
    assert encoded["bam"] == 3 * heads
    # the layouts add no parameter (iRoPE's temperature and SWAN-GPT's scaling have none)
    assert encoded["rnope_swa"] == encoded["swan"] == encoded["irope"] == encoded["gemma"] == 0
    # per layer: PaTH's W1 [32, E], W2 [E, 32], depthwise convolution over 3 tokens [E, 1, 3], beta's Linear(E, H)
    assert encoded["path"] == layers * (32 * width + width * 32 + 3 * width + width * heads + heads)


def test_compared_models_are_among_those_checked_here():
    """The comparisons' models (small and WikiText-103 alike) are built with the flags checked here."""
    for name, encoding in COMPARED.items():
        for size, wiki103 in (("", False), ("_wiki103", True)):
            assert encoding.model_flags(wiki103) == [f.format(size=size) for f in POSITION_ENCODINGS[name]], name
        assert encoding.eval_flags == EVALUATED_WITH.get(name, ()), name
    assert set(small_comparison.DEFAULT_MODELS) <= set(COMPARED)
    assert position_encoding("kerple_power").model_flags(True) == [
        "--arch", "transformer_lm_kerple_wiki103", "--bias-kernel", "kerple_power"]
    with pytest.raises(ValueError, match="unknown model 'learned'"):
        position_encoding("learned")


def test_small_comparison_models_differ_only_in_position():
    flags = model_size_flags(layers=2, width=128, heads=4, dropout=0.1)
    task = DictionaryTask(8000)
    torch.manual_seed(0)
    models = {name: build(name, "", flags, task) for name in POSITION_ENCODINGS}
    assert_differ_only_in_position(models)
    sizes = {name: sum(p.numel() for p in m.parameters()) for name, m in models.items()}
    assert sizes["sinusoidal"] == sizes["alibi"] == sizes["rotary"] == sizes["nope"]
    # the trap: stock transformer_lm, given the same flags and built as fairseq-train builds it (its
    # dataclass defaults filled in), keeps 512-wide input and output embeddings and post-LayerNorm
    args = options.parse_args_and_arch(options.get_training_parser(),
                                       ["data", "--task", "language_modeling", "--arch", "transformer_lm", *flags])
    stock = fairseq_models.build_model(convert_namespace_to_omegaconf(args).model, task)
    assert isinstance(stock, TransformerLanguageModel) and stock.decoder.embed_tokens.embedding_dim == 512
    assert sum(p.numel() for p in stock.parameters()) > 3 * sizes["sinusoidal"]
    assert not stock.decoder.layers[0].normalize_before


@pytest.mark.slow
def test_wikitext_103_models_differ_only_in_position():
    """ALiBi's 16-layer, 1024-wide model with adaptive input and softmax (cutoffs 20000, 60000)."""
    task = DictionaryTask(61000)
    models = {name: build(name, "_wiki103", [], task) for name in ("sinusoidal", "nope", "alibi", "kerple_log", "rotary")}
    signatures = {name: signature(model) for name, model in models.items()}
    for name, sig in signatures.items():
        assert sig == signatures["alibi"], name
    assert all(sig["normalize_before"] == [True] * 16 for sig in signatures.values())
