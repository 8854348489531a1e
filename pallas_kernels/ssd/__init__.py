"""Mamba-2 SSD: quadratic and sequential references, the chunked algorithm and Pallas kernels
(impl="pallas", tuned by BlockSizes)."""

from .chunked import ssd_chunked
from .ops import CHUNK_STATES, ssd
from .reference import segsum, ssd_reference, ssd_sequential
from .tiling import BlockSizes

__all__ = [
    "CHUNK_STATES",
    "BlockSizes",
    "segsum",
    "ssd",
    "ssd_chunked",
    "ssd_reference",
    "ssd_sequential",
]
