"""How exactly each attention backend forms the biased logits ``s * W + B`` in fp16 and bf16.

The score ``s = q . k`` of half-precision queries and keys is the same float32 value on every backend
that accumulates in float32; what differs is where it and the kernel's bias are rounded:

- **explicit** (half precision): ``s`` comes out of the matmul in the activation dtype, and is then
  taken to float32 with the float32 bias added;
- **sdpa**: the fused CUDA kernels accumulate ``s`` in float32 but read the bias laid out in the
  activation dtype, so the bias is rounded (bf16 keeps 8 significant bits: near -62 its spacing is
  0.25, an error of up to 0.125);
- **flex**: ``s`` in float32 and the float32 per-distance values added inside the kernel: exact to
  float32.

For each kernel (at its initial parameters, 8 heads) and length, the largest error of the logit
against float64 over every head, every distance below the length (a window's hidden distances
excluded) and ``samples`` scores drawn per distance from ``N(0, score_scale^2)``.
"""

from typing import Dict, List, Sequence

import torch
from torch import Tensor

from kerple_core.attention.distance_bias import DistanceBias
from kerple_core.kernels import build_kernel, kernel_names
from kerple_core.visibility import Visibility

HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}
BACKENDS = ("explicit", "sdpa", "flex")
#: the window of the ``window`` kernel here
WINDOW = 512


def rounded(x: Tensor, dtype: torch.dtype) -> Tensor:
    return x.to(dtype).float()


def logits(backend: str, scores: Tensor, weight: Tensor, bias: Tensor, dtype: torch.dtype) -> Tensor:
    """The float32 logits as ``backend`` forms them from float32 scores and the kernel's float32 values."""
    if backend == "explicit":
        return rounded(scores, dtype) * weight + bias
    if backend == "sdpa":
        return scores * rounded(weight, dtype) + rounded(bias, dtype)
    if backend == "flex":
        return scores * weight + bias
    raise ValueError(f"unknown backend {backend!r}")


def largest_errors(kernel_name: str, lengths: Sequence[int], heads: int = 8, samples: int = 4,
                   score_scale: float = 3.0, seed: int = 0) -> Dict[tuple, float]:
    """``{(backend, precision, length): largest |error|}`` for one kernel; sdpa is left out for a
    weight kernel, which it does not serve."""
    kernel = build_kernel(kernel_name, heads, None, head_dim=64)
    source = DistanceBias(kernel, Visibility(window=WINDOW if kernel.requires_window else 0))
    longest = max(lengths)
    with torch.no_grad():
        bias = source.per_distance(longest)
        weight = source.weight_per_distance(longest) if kernel.has_weight else torch.ones_like(bias)
    scores = score_scale * torch.randn(samples, heads, longest, generator=torch.Generator().manual_seed(seed))
    exact = scores.double() * weight.double() + bias.double()
    seen = torch.isfinite(bias).expand_as(scores)
    errors = {}
    for backend in BACKENDS:
        if backend == "sdpa" and kernel.has_weight:
            continue
        for precision, dtype in HALF.items():
            error = (logits(backend, scores, weight, bias, dtype).double() - exact).abs().masked_fill(~seen, 0.0)
            for length in lengths:
                errors[backend, precision, length] = error[..., :length].max().item()
    return errors


def table(kernels: Sequence[str] = (), lengths: Sequence[int] = (2048, 8192, 16384)) -> str:
    """The markdown table of :func:`largest_errors` for ``kernels`` (default: every distance kernel)."""
    kernels = list(kernels) or [name for name in kernel_names() if name != "none"]
    header = [f"{precision} {length}" for precision in HALF for length in lengths]
    rows: List[str] = ["| kernel | backend | " + " | ".join(header) + " |", "|---|---|" + "---|" * len(header)]
    for name in kernels:
        errors = largest_errors(name, lengths)
        for backend in BACKENDS:
            if (backend, "fp16", lengths[0]) in errors:
                cells = [f"{errors[backend, precision, length]:.2g}" for precision in HALF for length in lengths]
                rows.append(f"| {name} | {backend} | " + " | ".join(cells) + " |")
    return "\n".join(rows)
