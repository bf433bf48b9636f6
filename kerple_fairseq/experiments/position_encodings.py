"""The position encodings a comparison may hold, by name: each is a plugin architecture (and its
flags) that differs from the others only in how it encodes position (``tests/test_comparison_models.py``
checks it), at the small comparison's size or on ALiBi's WikiText-103 model."""

from typing import List, NamedTuple, Tuple

from kerple_fairseq.models.position_methods import ATTENTION_METHOD, choices, position_method
from kerple_fairseq.errors import KernelConfigError


# the families of the leaderboard's figure, a panel each, in its order
ABSOLUTE, BIAS, DAPE, ROTARY, CONTEXTUAL = (
    "absolute or none", "additive bias", "DAPE", "rotary", "contextual and attention rules")
FAMILIES = (ABSOLUTE, BIAS, DAPE, ROTARY, CONTEXTUAL)


class PositionEncoding(NamedTuple):
    label: str  # its name in tables
    architecture: str  # transformer_lm_<architecture>, or transformer_lm_<architecture>_wiki103
    flags: Tuple[str, ...] = ()
    eval_flags: Tuple[str, ...] = ()  # kerple-eval-lm options: an evaluation-time method on the trained model
    family: str = BIAS  # one of FAMILIES
    baseline: str = "alibi"  # the name of what it adds to (its family's baseline), compared besides ALiBi

    def model_flags(self, wiki103: bool = False) -> List[str]:
        """fairseq flags of the model: the architecture (ALiBi's WikiText-103 one if ``wiki103``) and its options."""
        return ["--arch", f"transformer_lm_{self.architecture}{'_wiki103' if wiki103 else ''}", *self.flags]


POSITION_ENCODINGS = {
    "sinusoidal": PositionEncoding("sinusoidal", "sinusoidal", family=ABSOLUTE),
    "rotary": PositionEncoding("rotary", "rotary", family=ROTARY),
    "nope": PositionEncoding("NoPE", "kerple", ("--bias-kernel", "none"), family=ABSOLUTE),
    "t5": PositionEncoding("T5", "kerple", ("--bias-kernel", "t5")),
    "alibi": PositionEncoding("ALiBi", "alibi"),
    "kerple_log": PositionEncoding("KERPLE-log", "kerple"),
    "fire": PositionEncoding("FIRE", "kerple", ("--bias-kernel", "fire")),
    "fox": PositionEncoding("FoX", "kerple", ("--bias-kernel", "fox")),
    "dape_alibi": PositionEncoding("DAPE-ALiBi", "alibi", ("--dape", "mlp"), family=DAPE),
    "dape_kerple_log": PositionEncoding("DAPE-KERPLE-log", "kerple", ("--dape", "mlp"), family=DAPE,
                                        baseline="kerple_log"),
    # rotary trained as `rotary` is (one checkpoint), then scaled at evaluation: by s = L / L_train at every
    # evaluated length,
    "rotary_ntk": PositionEncoding("rotary+NTK", "rotary", eval_flags=("--rotary-scaling", "ntk"), family=ROTARY,
                                   baseline="rotary"),
    # the same, with each query's own scale: the length it has reached over L_train
    "rotary_dynamic_ntk": PositionEncoding("rotary+dynamic NTK", "rotary", eval_flags=("--rotary-scaling", "dynamic-ntk"),
                                           family=ROTARY, baseline="rotary"),
    "rotary_yarn": PositionEncoding("rotary+YaRN", "rotary", eval_flags=("--rotary-scaling", "yarn"), family=ROTARY,
                                    baseline="rotary"),
    "xpos": PositionEncoding("xPos", "rotary", ("--rotary-xpos",), family=ROTARY, baseline="rotary"),
    "cope": PositionEncoding("CoPE", "cope", family=CONTEXTUAL, baseline="nope"),
    # no position encoding: the stick's order is the recency bias
    "stick_breaking": PositionEncoding("stick-breaking", "kerple", ("--bias-kernel", "none", "--stick-breaking"),
                                       family=CONTEXTUAL, baseline="nope"),
    "selective": PositionEncoding("NoPE+selective", "kerple", ("--bias-kernel", "none", "--selective-attention"),
                                  family=CONTEXTUAL, baseline="nope"),
    "ssmax": PositionEncoding("rotary+SSMax", "rotary", ("--ssmax",), family=ROTARY, baseline="rotary"),
    # rotary trained as `rotary` is, evaluated with ReRoPE's clamped (or leaky) relative positions and the
    # reference's query scale beyond the training length (named, so that results of either scale are never mixed)
    "rotary_rerope": PositionEncoding("rotary+ReRoPE", "rotary", eval_flags=(
        "--rotary-scaling", "rerope", "--model-overrides", "{'rerope_query_scale': 'log'}"), family=ROTARY,
        baseline="rotary"),
    "rotary_leaky_rerope": PositionEncoding("rotary+leaky ReRoPE", "rotary", eval_flags=(
        "--rotary-scaling", "leaky-rerope", "--model-overrides", "{'rerope_query_scale': 'log'}"), family=ROTARY,
        baseline="rotary"),
    # ReRoPE without the query scale, against ReRoPE with it
    "rotary_rerope_unscaled": PositionEncoding("rotary+ReRoPE, unscaled queries", "rotary", eval_flags=(
        "--rotary-scaling", "rerope", "--model-overrides", "{'rerope_query_scale': 'none'}"), family=ROTARY,
        baseline="rotary_rerope"),
    # p-RoPE at the fraction the paper favours
    "p_rope": PositionEncoding("p-RoPE 0.25", "rotary", ("--rotary-fraction", "0.25"), family=ROTARY,
                               baseline="rotary"),
    # BAM's prior with scalable softmax on the whole logit, the paper's pairing (s_h from 1, as BAM's code)
    "bam_ssmax": PositionEncoding("BAM+SSMax", "kerple", ("--bias-kernel", "bam", "--ssmax", "--ssmax-scale-init", "1")),
    # the same with SSMax on q.k alone, the bias unscaled, against the paper's
    "bam_ssmax_queries": PositionEncoding("BAM+SSMax on q.k", "kerple", (
        "--bias-kernel", "bam", "--ssmax", "--ssmax-scale-init", "1", "--ssmax-scope", "queries"),
        baseline="bam_ssmax"),
    # BAM's prior alone (its scale and shape learned, its location held: the reference's default), against ALiBi;
    # the committed perplexity boards' runs under these flags learned the location too (docs/small-comparison.md)
    "bam": PositionEncoding("BAM", "kerple", ("--bias-kernel", "bam")),
    # hybrid layouts over the comparison's two layers (their papers' 1 global layer in 4, or Gemma's 1 in 6, is
    # 1 in 2 here), the local layers' span a quarter of the training length: RNoPE-SWA (rotary in a sliding
    # window, a global NoPE layer),
    "rnope_swa": PositionEncoding("RNoPE-SWA", "kerple", ("--bias-kernel", "none", "--layer-positions", "rotary@16,nope"),
                                  family=ROTARY, baseline="rotary"),
    # SWAN-GPT: the same model, evaluated with its scaling of the global layers' queries
    "swan": PositionEncoding("SWAN-GPT", "kerple", ("--bias-kernel", "none", "--layer-positions", "rotary@16,nope"),
                             eval_flags=("--model-overrides", "{'swan_scaling': True}"), family=ROTARY,
                             baseline="rnope_swa"),
    # Llama 4's iRoPE: rotary with chunked attention, a global NoPE layer with the temperature (its floor scale
    # equal to the chunk, as Llama 4's 8192 is)
    "irope": PositionEncoding("iRoPE", "kerple", (
        "--bias-kernel", "none", "--layer-positions", "rotary+chunked,nope", "--attn-chunk-size", "16",
        "--attn-temperature-tuning", "--attn-temperature-floor-scale", "16"), family=ROTARY, baseline="rotary"),
    # Gemma-style: rotary everywhere, a sliding-window layer and a global one
    "gemma": PositionEncoding("rotary local/global", "kerple", (
        "--bias-kernel", "none", "--layer-positions", "rotary@16,rotary"), family=ROTARY, baseline="rotary"),
    # PaTH's accumulated Householder transforms of the keys, no other position encoding
    "path": PositionEncoding("PaTH", "kerple", ("--bias-kernel", "none", "--path-attention"), family=CONTEXTUAL,
                             baseline="nope"),
}
# learned positions are not among them: they cannot be evaluated beyond the training length


def position_encoding(name: str) -> PositionEncoding:
    """A comparison's position encoding; or any registered position method by name: a bias kernel or
    layer bias on ``transformer_lm_kerple``, an attention method over no position encoding (NoPE, its
    baseline); raises ``ValueError`` naming the choices for anything else."""
    if name in POSITION_ENCODINGS:
        return POSITION_ENCODINGS[name]
    try:
        kind, cls = position_method(name)
    except KernelConfigError as e:
        raise ValueError(f"unknown model {name!r}: choose a position encoding ({', '.join(POSITION_ENCODINGS)}) "
                         f"or a position method ({choices()})") from e
    if kind == ATTENTION_METHOD:
        flags = next(iter(cls.command_lines().values()))
        return PositionEncoding(name, "kerple", ("--bias-kernel", "none", *flags), family=CONTEXTUAL, baseline="nope")
    return PositionEncoding(name, "kerple", ("--bias-kernel", name))
