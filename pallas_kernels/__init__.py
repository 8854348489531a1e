"""Sequence-mixing ops for hax-jax: Mamba-1 selective scan and Mamba-2 SSD."""

from .selective_scan import selective_scan
from .ssd import ssd

__all__ = ["selective_scan", "ssd"]
