"""Mamba-2 SSD: quadratic and sequential references and the chunked algorithm."""

from .chunked import ssd_chunked
from .ops import ssd
from .reference import segsum, ssd_reference, ssd_sequential

__all__ = ["segsum", "ssd", "ssd_chunked", "ssd_reference", "ssd_sequential"]
