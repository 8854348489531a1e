"""Layers: norms, the causal conv, and the sequence mixers."""

# What a Mamba mixer's GEMMs made and its scan returned (in_proj's output before the conv, x_proj's,
# the scan's y): saved by name under model.remat="block_keep_scan" (models/lm.py), so a block's
# backward reruns no GEMM of them nor (with the SSD's chunk states) Mamba-2's scan.
SCAN_IO = "mixer_scan_io"
