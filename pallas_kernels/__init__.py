"""Sequence-mixing ops for hax-jax: Mamba-1 selective scan, Mamba-2 SSD, HAX sparse attention.

Every op folder names its files one way:
    ops.py          the public op: input checks, the `impl=` dispatch, the custom_vjp
    reference.py    the definition (the spec the other paths are tested against)
    <name>.py       the pure-JAX fast path, named as its function's suffix: ssd/chunked.py
                    (ssd_chunked), selective_scan/associative.py, sparse_attention/indexed.py
    pallas.py       the Pallas path between ops.py and the kernels: inputs padded and laid out,
                    a variant's kernels picked and chained, forward and backward assembled
    kernel.py       kernel code that both Pallas variants ("gpu" Triton, "tpu" Mosaic TPU) run
    kernel_<b>.py   kernel bodies of one backend only: kernel_gpu.py, kernel_tpu.py,
                    kernel_mgpu.py (Mosaic GPU)
    tiling.py       BlockSizes and how arrays are cut into blocks (block specs, layouts)
    decode.py       the decode step and the parallel prefill of its cache (sparse attention)
"""

from .selective_scan import selective_scan
from .sparse_attention import sparse_attention
from .ssd import ssd

__all__ = ["selective_scan", "sparse_attention", "ssd"]
