"""Mamba-1 selective scan (S6): reference recurrence and a chunked associative-scan path."""

from .associative import selective_scan_associative
from .ops import selective_scan
from .reference import selective_scan_reference

__all__ = ["selective_scan", "selective_scan_associative", "selective_scan_reference"]
