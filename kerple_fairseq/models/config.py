"""The plugin's model options: fairseq's ``transformer_lm`` options plus the kernel's."""

import dataclasses
from dataclasses import field

from fairseq.dataclass import ChoiceEnum
from fairseq.models.transformer_lm import TransformerLanguageModelConfig

from kerple_core.attention.attend import BACKENDS
from kerple_core.attention.backends import choices_help
from kerple_core.attention.blocks import CPU_BLOCK_SCORES
from kerple_core.attention.methods import attention_method_option_fields
from kerple_fairseq.models.position_methods import bias_names
from kerple_core.attention.rotary import rotary_option_fields
from kerple_core.kernels import option_fields
from kerple_core.kernels.registry import SAVED_BEFORE
from kerple_core.layer_biases import layer_bias_option_fields
from kerple_core.visibility import visibility_rule_option_fields

DEFAULT_BLOCK_SIZE = 1024


def _make_config():
    plugin_fields = [
        (
            "bias_kernel",
            ChoiceEnum(bias_names()),
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
            "layer_positions",
            str,
            field(
                default="",
                metadata={
                    "help": "each layer's own position encoding and window, as comma-separated entries repeated over "
                    "the layers: NAME[+NAME...][@WINDOW] with rotary, nope, a --bias-kernel name or an attention "
                    "method, e.g. 'rotary@128,rotary@128,rotary@128,nope' (3 rotary sliding-window layers to 1 "
                    "global NoPE layer); replaces --bias-kernel, --rotary-embeddings and --attn-window; '': every "
                    "layer the model's"
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
            "cpu_attention_block_scores",
            int,
            field(
                default=CPU_BLOCK_SCORES,
                metadata={
                    "help": "on a CPU, blocks of queries whose scores an attention method works on (DAPE, CoPE, "
                    "selective, PaTH, stick-breaking) are cut further to hold at most this many scores (batch x "
                    "heads x queries x keys; at least 16 queries), which keeps them in the caches; 0: blocks "
                    "of --attention-block-size queries, as on a GPU. Changes speed, not the result",
                    # the same speed-up for a checkpoint saved before the option, which gets the key so that
                    # --model-overrides reach it
                    SAVED_BEFORE: CPU_BLOCK_SCORES,
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
            field(default="auto", metadata={"help": choices_help()}),
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
        # rotary's options: --rotary-scaling's and those each scaling declares
        *copied(rotary_option_fields()),
    ]
    # each kernel, layer bias, visibility rule and attention method declares its own options
    plugin_fields += copied(option_fields() + layer_bias_option_fields() + visibility_rule_option_fields() +
                            attention_method_option_fields())
    return dataclasses.make_dataclass(
        "KernelBiasedLMConfig",
        plugin_fields,
        bases=(TransformerLanguageModelConfig,),
        namespace={"__doc__": "transformer_lm options plus --bias-kernel and the options of every kernel, layer "
                              "bias, visibility rule, attention method and rotary scaling."},
    )


def copied(fields) -> list:
    """``fields`` as entries of the configuration, copied so that it owns them."""
    return [(f.name, f.type, field(default=f.default, metadata=dict(f.metadata))) for f in fields]


KernelBiasedLMConfig = _make_config()


def saved_before() -> dict:
    """Each option added with a new behaviour, by name: the value checkpoints saved before it get."""
    return {f.name: f.metadata[SAVED_BEFORE] for f in dataclasses.fields(KernelBiasedLMConfig)
            if SAVED_BEFORE in f.metadata}
