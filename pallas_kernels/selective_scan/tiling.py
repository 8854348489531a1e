"""Tiling of the Pallas selective scan: tuning knobs, chunk and channel blocking, padding.

Shared by the gpu (kernel_gpu.py) and tpu (kernel_tpu.py) variants. Padding is inert: padded
steps have dt = 0 (decay 1, no input), padded channels x = dt = 0, padded state columns
A = B = C = 0 (decay 1, no input, no output), so the kernels never mask.
"""

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp

from ..backend import check_variant
from .kernel import F32


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
    """Tuning knobs of the Pallas selective scan; None takes the variant's default.

    gpu: keep block_d < 32 * num_warps (and the same for the backward): a row of block_d
    channels that has at least one element per thread is loaded in a layout of its own and
    converted through shared memory every step."""

    chunk: int | None = None  # forward steps whose loads are issued together
    chunk_bwd: int | None = None  # backward steps per recompute (divides chunk); the forward
    # saves the fp32 state every chunk_bwd steps: (b, l / chunk_bwd, d, n) for the backward
    block_d: int | None = None  # channels per forward program
    block_d_bwd: int | None = None  # channels per backward program
    num_warps: int | None = None  # Triton warps per forward program (gpu only)
    num_warps_bwd: int | None = None  # Triton warps per backward program (gpu only)


DEFAULTS = {
    # Measured on an H100 (bench/selective_scan_kernel.py, BENCHMARKS.md): of five candidates
    # picked from Triton 3.6 / ptxas sm_90 builds (registers, spills, no shared-memory layout
    # conversions in the loops), 8-channel programs with 4-step backward chunks were fastest
    # forward+backward at both issue shapes.
    "gpu": BlockSizes(
        chunk=16, chunk_bwd=4, block_d=8, block_d_bwd=8, num_warps=1, num_warps_bwd=1
    ),
    # Mosaic: channels fill the 128 lanes; chunk rows are a multiple of the 8 sublanes.
    "tpu": BlockSizes(
        chunk=32, chunk_bwd=16, block_d=128, block_d_bwd=128, num_warps=1, num_warps_bwd=1
    ),
}


def resolve_block_sizes(variant, block_sizes=None):
    """The variant's defaults overridden by the set fields of `block_sizes`; checked."""
    check_variant(variant)
    chosen = {
        k: v for k, v in dataclasses.asdict(block_sizes or BlockSizes()).items() if v is not None
    }
    sizes = dataclasses.replace(DEFAULTS[variant], **chosen)
    for name, value in dataclasses.asdict(sizes).items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"block_sizes.{name} must be a positive int, got {value!r}")
    if variant == "gpu":  # Triton: power-of-two tensor shapes
        for name in ("chunk", "chunk_bwd", "block_d", "block_d_bwd"):
            value = getattr(sizes, name)
            if value & (value - 1):
                raise ValueError(f"block_sizes.{name} must be a power of two on gpu, got {value}")
    else:  # Mosaic: blocks end in (8k, 128k)
        for name, multiple in (
            ("chunk", 8),
            ("chunk_bwd", 8),
            ("block_d", 128),
            ("block_d_bwd", 128),
        ):
            value = getattr(sizes, name)
            if value % multiple:
                raise ValueError(
                    f"block_sizes.{name} must be a multiple of {multiple} on tpu, got {value}"
                )
    if sizes.chunk % sizes.chunk_bwd:
        raise ValueError(
            f"block_sizes.chunk_bwd must divide chunk = {sizes.chunk}, got {sizes.chunk_bwd}"
        )
    return sizes


def _round_up(n, m):
    """The smallest multiple of m that is >= n."""
    return -(-n // m) * m


class Geometry(NamedTuple):
    """Padded sizes of one call: l_pad = num_chunks * chunk, d_pad = num_blocks * block_d;
    the state is saved every save_every steps (a divisor of chunk)."""

    chunk: int
    num_chunks: int
    save_every: int
    block_d: int
    num_blocks: int
    n_pad: int

    @property
    def l_pad(self):
        """Padded sequence length."""
        return self.chunk * self.num_chunks

    @property
    def d_pad(self):
        """Padded channel count."""
        return self.block_d * self.num_blocks

    @property
    def num_saved(self):
        """Saved states: one per save_every steps."""
        return self.l_pad // self.save_every


def geometry(variant, l, d, n, chunk, chunk_bwd, block_d):
    """Chunking and channel blocking of a (l, d, n) problem for `variant`; the backward's
    geometry is the one with chunk = chunk_bwd (its chunks are the forward's save spacing)."""
    if variant == "gpu":  # Triton: power-of-two tiles; a short sequence shrinks the chunks
        steps = 1 << (l - 1).bit_length()
        save_every = min(chunk_bwd, steps)
        chunk = min(chunk, steps)
        block_d = min(block_d, 1 << (d - 1).bit_length())
        n_pad = 1 << (n - 1).bit_length()
    else:  # Mosaic: chunks of 8k rows; channel blocks of 128 lanes or the whole axis
        save_every = chunk_bwd
        chunk = min(chunk, _round_up(l, save_every))
        block_d = d if d <= block_d else block_d
        n_pad = _round_up(n, 8)
    return Geometry(chunk, -(-l // chunk), save_every, block_d, -(-d // block_d), n_pad)


def pad_to(arr, shape):
    """Zero-pad `arr` at the end of each axis to `shape` (no-op when it already fits)."""
    widths = [(0, s - a) for a, s in zip(arr.shape, shape, strict=True)]
    return jnp.pad(arr, widths) if any(w for _, w in widths) else arr


def padded_inputs(geo, x, dt, A, B, C, D, z, initial_state, *, z_start=0, variant="gpu"):
    """Inputs padded to the geometry: x, dt, z keep their dtypes; A, B, C, D, initial_state
    in fp32 (B and C are small, b l n, and a kernel loading them in bf16 would convert n values
    per step and thread); D=None as zeros. The gate is z's channels z_start .. z_start + d:
    read in place ("z_block": its first channel block) where the gpu kernels need no padding and
    z_start is a whole number of channel blocks, else sliced out and padded."""
    b, l, d = x.shape
    seq = (b, geo.l_pad, geo.d_pad)
    bc = (b, geo.l_pad, geo.n_pad)
    D = jnp.zeros((d,), F32) if D is None else D.astype(F32)
    z_block, in_place = 0, False
    if z is not None and (z_start or z.shape[2] != d):
        aligned = (geo.l_pad, geo.d_pad) == (l, d) and z_start % geo.block_d == 0
        in_place = variant == "gpu" and aligned
        if in_place:
            z_block = z_start // geo.block_d
        else:
            z = z[..., z_start : z_start + d]
    return dict(
        x=pad_to(x, seq),
        dt=pad_to(dt, seq),
        z=None if z is None else (z if in_place else pad_to(z, seq)),
        z_block=z_block,
        B=pad_to(B.astype(F32), bc),
        C=pad_to(C.astype(F32), bc),
        A=pad_to(A.astype(F32), (geo.d_pad, geo.n_pad)),
        D=pad_to(D, (geo.d_pad,)),
        h0=None
        if initial_state is None
        else pad_to(initial_state.astype(F32), (b, geo.d_pad, geo.n_pad)),
    )
