"""Sequence-mixing ops for hax-jax: Mamba-1 selective scan, Mamba-2 SSD, HAX sparse attention."""

from .selective_scan import selective_scan
from .sparse_attention import sparse_attention
from .ssd import ssd

__all__ = ["selective_scan", "sparse_attention", "ssd"]
