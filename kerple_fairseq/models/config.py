"""The plugin's model options: fairseq's ``transformer_lm`` options plus the kernel's."""

import dataclasses
from dataclasses import field

from fairseq.dataclass import ChoiceEnum
from fairseq.models.transformer_lm import TransformerLanguageModelConfig

from kerple_fairseq.attention.attend import BACKENDS
from kerple_fairseq.attention.dape import VARIANTS as DAPE_VARIANTS
from kerple_fairseq.attention.query_scaling import SSMAX_SCALE_INIT, TEMPERATURE_FLOOR_SCALE, TEMPERATURE_SCALE
from kerple_fairseq.attention.rotary import DYNAMIC_NTK_STEP, REROPE_LEAK, ROTARY_SCALINGS
from kerple_fairseq.kernels import kernel_names, option_fields
from kerple_fairseq.layer_biases import layer_bias_names, layer_bias_option_fields

DEFAULT_BLOCK_SIZE = 1024


def _make_config():
    plugin_fields = [
        (
            "bias_kernel",
            ChoiceEnum(sorted(kernel_names() + layer_bias_names())),
            field(default="kerple_log", metadata={
                "help": "positional attention-bias kernel (fire, fox, fox_bias_only: a bias of each layer's own)"}),
        ),
        (
            "token_positional_embeddings",
            bool,
            field(
                default=False,
                metadata={
                    "help": "also add fairseq's token positional embeddings (sinusoidal, or learned "
                    "with --decoder-learned-pos); only with --bias-kernel none, since every other "
                    "kernel already encodes position"
                },
            ),
        ),
        (
            "attn_window",
            int,
            field(
                default=0,
                metadata={
                    "help": "each query sees only the W most recent keys (itself included); composes "
                    "with every kernel and can be set at evaluation only, e.g. "
                    "--model-overrides \"{'attn_window': 512}\" (KERPLE's 'windowed@512'); 0: no window"
                },
            ),
        ),
        (
            "attention_block_size",
            int,
            field(
                default=DEFAULT_BLOCK_SIZE,
                metadata={
                    "help": "sequences longer than this are attended one block of this many queries at a "
                    "time, so no L x L bias or score tensor exists (with --attn-window W, blocks of at most "
                    "max(W, 64) queries and only the keys inside the window); 0: always one L x L block. "
                    "Changes memory and speed, not the result"
                },
            ),
        ),
        (
            "max_cache_window",
            int,
            field(
                default=0,
                metadata={
                    "help": "incremental decoding (generation) keeps only the last W keys and values per "
                    "layer, so each new token costs O(W) (Sandwich App. B); the model then attends as with "
                    "--attn-window W. Set it at generation time: --model-overrides \"{'max_cache_window': W}\"; "
                    "0: keep every key"
                },
            ),
        ),
        (
            "attention_backend",
            ChoiceEnum(list(BACKENDS)),
            field(
                default="auto",
                metadata={
                    "help": "how attention is computed: flex (FlexAttention, the bias read inside the fused "
                    "kernel; on CPU only without gradients), sdpa (PyTorch's scaled_dot_product_attention "
                    "with the bias laid out as a mask), explicit (matmul and softmax, the reference path); "
                    "auto: flex on CUDA and for long evaluation blocks on CPU, else sdpa. Methods a backend "
                    "cannot serve fall back (DAPE and CoPE: explicit)"
                },
            ),
        ),
        (
            "unfused_attention",
            bool,
            field(
                default=False,
                metadata={"help": "the same as --attention-backend explicit"},
            ),
        ),
        (
            "rotary_embeddings",
            bool,
            field(
                default=False,
                metadata={
                    "help": "rotate queries and keys by position (RoPE); only with --bias-kernel none "
                    "or window (rotary plus --attn-window is the super-baseline)"
                },
            ),
        ),
        (
            "rotary_xpos",
            bool,
            field(
                default=False,
                metadata={
                    "help": "xPos: with --rotary-embeddings, pair k of each logit decays as "
                    "zeta_k^((i - j) / --xpos-scale-base), zeta_k = (2k + 0.4 D) / (1.4 D)"
                },
            ),
        ),
        ("xpos_scale_base", float, field(default=512.0, metadata={"help": "xPos: the decay's scale base"})),
        (
            "rotary_scaling",
            ChoiceEnum(list(ROTARY_SCALINGS)),
            field(
                default="none",
                metadata={
                    "help": "scale rotary beyond the training length (--tokens-per-sample), by s = "
                    "--rotary-scaling-length / training length: ntk (base b s^(D/(D-2))), yarn (frequencies "
                    "ramped to theta/s, logits times (0.1 ln s + 1)^2); dynamic-ntk: ntk with s from the "
                    "length each query has reached (in bands of --dynamic-ntk-step); rerope: relative "
                    "positions from --rerope-window w on seen as w (leaky-rerope: w + (i - j - w) / "
                    "--rerope-leak); at evaluation: kerple-eval-lm --rotary-scaling, or --model-overrides"
                },
            ),
        ),
        (
            "rotary_scaling_length",
            int,
            field(default=0, metadata={"help": "the length L_eval of s = L_eval / training length for ntk and "
                                       "yarn (kerple-eval-lm sets it per evaluated length); 0: s = 1"}),
        ),
        (
            "dynamic_ntk_step",
            int,
            field(default=DYNAMIC_NTK_STEP, metadata={
                "help": "dynamic-ntk: queries beyond the training length share one scale per band of this "
                "many positions (1: every query its own; larger bands attend in fewer, larger blocks)"}),
        ),
        (
            "dape",
            ChoiceEnum(list(DAPE_VARIANTS)),
            field(
                default="none",
                metadata={
                    "help": "DAPE: add a learned function of every head's scaled scores and bias to the logits "
                    "(mlp: per (i, j), DAPE v1; conv: along the keys, DAPE v2); composes with every kernel and "
                    "rotary; attention then runs on the explicit path, block by block"
                },
            ),
        ),
        (
            "cope",
            bool,
            field(
                default=False,
                metadata={
                    "help": "CoPE: add q . e(p) to the logits, p the sum of the query's gates sigmoid(q . k) from "
                    "each key to itself, e a learned table per layer read between integer positions; composes "
                    "with every kernel and rotary; attention then runs on the explicit path, block by block"
                },
            ),
        ),
        (
            "cope_max_positions",
            int,
            field(default=0, metadata={"help": "CoPE: positions in each layer's table (counts are clipped below "
                                       "it); 0: --tokens-per-sample + 1"}),
        ),
        (
            "rerope_window",
            int,
            field(default=0, metadata={"help": "ReRoPE's window w (--rotary-scaling rerope, leaky-rerope); "
                                       "0: a quarter of the training length"}),
        ),
        (
            "rerope_leak",
            float,
            field(default=REROPE_LEAK, metadata={"help": "leaky ReRoPE's k: distances beyond the window grow by "
                                                 "1/k per position"}),
        ),
        (
            "stick_breaking",
            bool,
            field(
                default=False,
                metadata={
                    "help": "stick-breaking attention instead of the softmax: key j < i gets sigmoid(z_ij) of "
                    "what the keys between them left, the remainder goes to the query's own value; composes "
                    "with every kernel (usually none) and logit method; attention then runs on the explicit "
                    "path, block by block"
                },
            ),
        ),
        (
            "selective_attention",
            bool,
            field(
                default=False,
                metadata={
                    "help": "selective attention: head 0's positive logits, summed over earlier queries, are "
                    "subtracted from every head's logits (no parameters); composes with every kernel and "
                    "rotary, not with DAPE, CoPE or ReRoPE; the explicit path, block by block"
                },
            ),
        ),
        (
            "ssmax",
            bool,
            field(
                default=False,
                metadata={
                    "help": "scalable softmax: each query times s_h log(n), n the keys it attends to, s_h learned "
                    "per head and layer; composes with every method and backend"
                },
            ),
        ),
        ("ssmax_scale_init", float, field(default=SSMAX_SCALE_INIT, metadata={
            "help": "scalable softmax: the initial s_h"})),
        (
            "attn_temperature_tuning",
            bool,
            field(
                default=False,
                metadata={
                    "help": "Llama 4's attention temperature: the query at position i times 1 + "
                    "--attn-temperature-scale * log(floor((i + 1) / --attn-temperature-floor-scale) + 1); "
                    "for evaluation of any model: --model-overrides \"{'attn_temperature_tuning': True}\""
                },
            ),
        ),
        ("attn_temperature_floor_scale", int, field(default=TEMPERATURE_FLOOR_SCALE, metadata={
            "help": "Llama 4's attention temperature: positions per step of the floor (its floor_scale)"})),
        ("attn_temperature_scale", float, field(default=TEMPERATURE_SCALE, metadata={
            "help": "Llama 4's attention temperature: beta (its attn_scale)"})),
        ("dape_width", int, field(default=32, metadata={"help": "DAPE: hidden width of each layer's network"})),
        (
            "dape_kernel_size",
            int,
            field(default=3, metadata={"help": "DAPE v2 (--dape conv): odd kernel size along the keys"}),
        ),
    ]
    # each kernel and layer bias declares its own options; copy them so this dataclass owns its fields
    for f in option_fields() + layer_bias_option_fields():
        plugin_fields.append((f.name, f.type, field(default=f.default, metadata=dict(f.metadata))))
    return dataclasses.make_dataclass(
        "KernelBiasedLMConfig",
        plugin_fields,
        bases=(TransformerLanguageModelConfig,),
        namespace={"__doc__": "transformer_lm options plus --bias-kernel and every kernel's options."},
    )


KernelBiasedLMConfig = _make_config()
