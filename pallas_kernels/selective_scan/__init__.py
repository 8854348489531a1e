"""Mamba-1 selective scan (S6): reference recurrence, a chunked associative-scan path and
fused Pallas kernels (impl="pallas", tuned by BlockSizes)."""

from .associative import selective_scan_associative
from .ops import saved_states_bytes, selective_scan
from .reference import selective_scan_reference
from .tiling import BlockSizes

__all__ = [
    "BlockSizes",
    "saved_states_bytes",
    "selective_scan",
    "selective_scan_associative",
    "selective_scan_reference",
]
