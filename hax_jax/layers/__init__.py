"""Layers: norms, the causal conv, and the sequence mixers."""
