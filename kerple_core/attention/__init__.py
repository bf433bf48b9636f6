"""Attention with a positional bias: the math (:mod:`attend`, :mod:`blocks`, the bias sources) apart
from the module (:mod:`self_attention`)."""
