"""The position encodings a comparison may hold, by name: each is a plugin architecture (and its
flags) that differs from the others only in how it encodes position (``tests/test_comparison_models.py``
checks it), at the small comparison's size or on ALiBi's WikiText-103 model."""

from typing import List, NamedTuple, Tuple

from kerple_fairseq.kernels import kernel_names
from kerple_fairseq.layer_biases import layer_bias_names


class PositionEncoding(NamedTuple):
    label: str  # its name in tables
    architecture: str  # transformer_lm_<architecture>, or transformer_lm_<architecture>_wiki103
    flags: Tuple[str, ...] = ()
    eval_flags: Tuple[str, ...] = ()  # kerple-eval-lm options: an evaluation-time method on the trained model

    def model_flags(self, wiki103: bool = False) -> List[str]:
        """fairseq flags of the model: the architecture (ALiBi's WikiText-103 one if ``wiki103``) and its options."""
        return ["--arch", f"transformer_lm_{self.architecture}{'_wiki103' if wiki103 else ''}", *self.flags]


POSITION_ENCODINGS = {
    "sinusoidal": PositionEncoding("sinusoidal", "sinusoidal"),
    "rotary": PositionEncoding("rotary", "rotary"),
    "nope": PositionEncoding("NoPE", "kerple", ("--bias-kernel", "none")),
    "t5": PositionEncoding("T5", "kerple", ("--bias-kernel", "t5")),
    "alibi": PositionEncoding("ALiBi", "alibi"),
    "kerple_log": PositionEncoding("KERPLE-log", "kerple"),
    "fire": PositionEncoding("FIRE", "kerple", ("--bias-kernel", "fire")),
    "fox": PositionEncoding("FoX", "kerple", ("--bias-kernel", "fox")),
    "dape_alibi": PositionEncoding("DAPE-ALiBi", "alibi", ("--dape", "mlp")),
    "dape_kerple_log": PositionEncoding("DAPE-KERPLE-log", "kerple", ("--dape", "mlp")),
    # rotary trained as `rotary` is, then scaled at evaluation: by s = L / L_train at every evaluated length,
    "rotary_ntk": PositionEncoding("rotary+NTK", "rotary", ("--rotary-scaling", "ntk")),
    # the same, with each query's own scale: the length it has reached over L_train
    "rotary_dynamic_ntk": PositionEncoding("rotary+dynamic NTK", "rotary", ("--rotary-scaling", "dynamic-ntk")),
    "rotary_yarn": PositionEncoding("rotary+YaRN", "rotary", ("--rotary-scaling", "yarn")),
    "xpos": PositionEncoding("xPos", "rotary", ("--rotary-xpos",)),
    "cope": PositionEncoding("CoPE", "cope"),
    # no position encoding: the stick's order is the recency bias
    "stick_breaking": PositionEncoding("stick-breaking", "kerple", ("--bias-kernel", "none", "--stick-breaking")),
    "selective": PositionEncoding("NoPE+selective", "kerple", ("--bias-kernel", "none", "--selective-attention")),
    "ssmax": PositionEncoding("rotary+SSMax", "rotary", ("--ssmax",)),
    # rotary trained as `rotary` is, evaluated with ReRoPE's clamped (or leaky) relative positions
    "rotary_rerope": PositionEncoding("rotary+ReRoPE", "rotary", eval_flags=("--rotary-scaling", "rerope")),
    "rotary_leaky_rerope": PositionEncoding("rotary+leaky ReRoPE", "rotary",
                                            eval_flags=("--rotary-scaling", "leaky-rerope")),
}
# learned positions are not among them: they cannot be evaluated beyond the training length


def position_encoding(name: str) -> PositionEncoding:
    """A comparison's position encoding, or any bias kernel on ``transformer_lm_kerple``; raises
    ``ValueError`` naming the choices for anything else."""
    if name in POSITION_ENCODINGS:
        return POSITION_ENCODINGS[name]
    kernels = sorted(kernel_names() + layer_bias_names())
    if name in kernels:
        return PositionEncoding(name, "kerple", ("--bias-kernel", name))
    raise ValueError(f"unknown model {name!r}: choose a position encoding ({', '.join(POSITION_ENCODINGS)}) "
                     f"or a bias kernel ({', '.join(kernels)})")
