"""The precision the plugin computes in: biases, gates, sums and softmaxes in float32 whatever the
model's dtype (half precision included), in float64 when the model is float64."""

import torch


def precise(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32
