"""Mamba-2's gated, grouped RMSNorm: the definition and its Triton kernels."""

from .ops import gated_rms_norm
from .reference import gated_rms_norm_reference

__all__ = ["gated_rms_norm", "gated_rms_norm_reference"]
