"""The depthwise causal conv's Triton kernels (the definition: hax_jax/layers/conv.py)."""

from .ops import causal_conv1d_pallas, supports

__all__ = ["causal_conv1d_pallas", "supports"]
