"""Tiling of the Pallas SSD: the tuning knobs (rows per tile, heads per backward program, Triton
warps, whether the chunk_state / chunk_out kernels are the Mosaic GPU ones) and the block specs
of each variant."""

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ..backend import check_variant


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
    """Tuning knobs of the Pallas SSD; None takes the variant's default. Tiles divide the chunk
    (the whole chunk when it is shorter than the default)."""

    tile: int | None = None  # rows per forward tile: a (tile, tile) fp32 score block per step
    tile_bwd: int | None = None  # rows per backward tile
    heads_per_block: int | None = None  # heads of one group per backward program (divides
    # heads // groups): their dB / dC leave the kernel summed over the block
    num_warps: int | None = None  # Triton warps per forward program (gpu only)
    num_warps_bwd: int | None = None  # Triton warps per backward program (gpu only)
    num_stages: int | None = None  # Triton software-pipelining stages, forward (gpu only)
    num_stages_bwd: int | None = None  # the same for the backward kernels (gpu only)
    heads_per_program: int | None = None  # heads of one group per Mosaic GPU chunk_state /
    # chunk_out program (divides heads // groups); None: kernel_mgpu's choice for the grid
    state_rows: int | None = None  # rows of p per state-passing program (a power of two; gpu
    # only); None: state_passing.py's choice for the grid
    state_warps: int | None = None  # Triton warps per state-passing program (gpu only)
    mosaic_gpu: bool | None = None  # chunk_state / chunk_out by Mosaic GPU (kernel_mgpu.py)
    # instead of Triton: None = on Hopper when the inputs suit them (bf16 / f16, p and n
    # multiples of 64, chunk a multiple of 128); True forces them (interpreted on CPU)


# gpu: (64, 64) fp32 score tiles; tpu: 128 rows (the lane width).
_TILE = {"gpu": 64, "tpu": 128}


def _default_heads_per_block(r):
    """The largest power of two <= 16 dividing r (heads per group): fewer, larger programs
    and up to 16x smaller dB / dC sums (16 measured faster than 8 and 4 at 80 heads)."""
    hb = 1
    while hb < 16 and r % (2 * hb) == 0:
        hb *= 2
    return hb


def resolve_block_sizes(variant, chunk_size, heads_per_group, block_sizes=None):
    """`block_sizes` with the variant's defaults filled in; ValueError naming a bad field."""
    check_variant(variant)
    sizes = block_sizes or BlockSizes()
    if not (sizes.mosaic_gpu is None or isinstance(sizes.mosaic_gpu, bool)):
        raise ValueError(f"block_sizes.mosaic_gpu must be None or a bool, got {sizes.mosaic_gpu!r}")
    if sizes.mosaic_gpu and variant != "gpu":
        raise ValueError(f"block_sizes.mosaic_gpu=True needs the gpu variant, got {variant!r}")
    for name, value in dataclasses.asdict(sizes).items():
        if name == "mosaic_gpu":
            continue
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value <= 0
        ):
            raise ValueError(f"block_sizes.{name} must be a positive int, got {value!r}")
    tile = min(chunk_size, _TILE[variant])
    sizes = BlockSizes(
        tile=sizes.tile or tile,
        tile_bwd=sizes.tile_bwd or tile,
        heads_per_block=sizes.heads_per_block or _default_heads_per_block(heads_per_group),
        heads_per_program=sizes.heads_per_program,
        state_rows=sizes.state_rows,
        state_warps=sizes.state_warps or 4,
        num_warps=sizes.num_warps or 4,
        num_warps_bwd=sizes.num_warps_bwd or 4,
        num_stages=sizes.num_stages or 2,
        num_stages_bwd=sizes.num_stages_bwd or 2,
        mosaic_gpu=sizes.mosaic_gpu,
    )
    for name in ("tile", "tile_bwd"):
        if chunk_size % getattr(sizes, name):
            raise ValueError(
                f"block_sizes.{name} must divide chunk_size = {chunk_size}, "
                f"got {getattr(sizes, name)}"
            )
    for name in ("heads_per_block", "heads_per_program"):
        value = getattr(sizes, name)
        if value is not None and heads_per_group % value:
            raise ValueError(
                f"block_sizes.{name} must divide the heads per group = {heads_per_group}, "
                f"got {value}"
            )
    if sizes.state_rows is not None and sizes.state_rows & (sizes.state_rows - 1):
        raise ValueError(f"block_sizes.state_rows must be a power of two, got {sizes.state_rows}")
    return sizes


class Layout:
    """Block specs of one variant for grids (b, head block, c) and (b, head block, c, tile).

    A program sees `hb` consecutive heads (of one group). gpu: x-like (b, l, h, p), B-like
    (b, l, g, n); tpu: x-like (b, h, l, p), B-like (b, g, l, n). Per-position vectors are
    (b, h, c, k, 1) columns and (b, h, c, 1, k) rows; seq ids (b, c, k, 1) / (b, c, 1, k);
    states (b, c, h, p, n); D (h, 1, 1); per-head-block sums x-like with h / hb "heads"."""

    def __init__(self, variant, k, tile, r, hb=1):
        self.variant, self.k, self.tile, self.hb = variant, k, tile, hb
        self.blocks_per_group = r // hb
        self.gpu = variant == "gpu"

    def seq_major(self, arr):
        """A (b, l, h, f) array in this variant's layout."""
        return arr if self.gpu else jnp.moveaxis(arr, 2, 1)

    def from_seq_major(self, arr):
        """Back to (b, l, h, f)."""
        return arr if self.gpu else jnp.moveaxis(arr, 1, 2)

    def _x_like(self, rows, heads, f, row_block, head_block):
        """Block (rows, heads, f) of an x-like array in this layout."""
        if self.gpu:
            return pl.BlockSpec(
                (None, rows, heads, f),
                lambda b, hb, c, *i: (b, row_block(c, *i), head_block(hb), 0),
            )
        return pl.BlockSpec(
            (None, heads, rows, f), lambda b, hb, c, *i: (b, head_block(hb), row_block(c, *i), 0)
        )

    def chunk(self, f):
        """The whole chunk of an x-like array, this program's heads."""
        return self._x_like(self.k, self.hb, f, lambda c, *i: c, lambda hb: hb)

    def group_chunk(self, f):
        """The whole chunk of a B-like array, this program's group."""
        per = self.blocks_per_group
        return self._x_like(self.k, None, f, lambda c, *i: c, lambda hb: jax.lax.div(hb, per))

    def tile_of(self, f, heads=True):
        """Tile i of chunk c of an x-like array (this program's heads), or of a per-head-block
        sum (heads=False)."""
        per = self.k // self.tile
        return self._x_like(
            self.tile, self.hb if heads else None, f, lambda c, i: c * per + i, lambda hb: hb
        )

    def scores(self):
        """The chunk's C B^T (k, k) of this program's group, from (b, c, g, k, k)."""
        per = self.blocks_per_group
        return pl.BlockSpec(
            (None, None, None, self.k, self.k),
            lambda b, hb, c, *i: (b, c, jax.lax.div(hb, per), 0, 0),
        )

    def column(self):
        """Per-position (b, h, c, k, 1) vectors, whole chunk."""
        return pl.BlockSpec((None, self.hb, None, self.k, 1), lambda b, hb, c, *i: (b, hb, c, 0, 0))

    def row(self):
        """Per-position (b, h, c, 1, k) vectors, whole chunk."""
        return pl.BlockSpec((None, self.hb, None, 1, self.k), lambda b, hb, c, *i: (b, hb, c, 0, 0))

    def score_rows(self):
        """Rows of tile i of a (b, c, h / hb, k, k) per-head-block score gradient."""
        return pl.BlockSpec(
            (None, None, None, self.tile, self.k), lambda b, hb, c, i: (b, c, hb, i, 0)
        )

    def row_partial(self):
        """Per source tile i, (b, h, c, k / tile, 1, k) per-position partial rows."""
        return pl.BlockSpec(
            (None, self.hb, None, None, 1, self.k), lambda b, hb, c, i: (b, hb, c, i, 0, 0)
        )

    def per_tile_scalar(self):
        """One (1, 1) value per program of a (b, h, c, k / tile, 1, 1) array (one head per
        program)."""
        return pl.BlockSpec((None, None, None, None, 1, 1), lambda b, hb, c, i: (b, hb, c, i, 0, 0))

    def column_tile(self):
        """Tile i of per-position columns (outputs)."""
        return pl.BlockSpec(
            (None, self.hb, None, self.tile, 1), lambda b, hb, c, i: (b, hb, c, i, 0)
        )

    def seq_column(self):
        """Document ids (b, c, k, 1) of the chunk."""
        return pl.BlockSpec((None, None, self.k, 1), lambda b, hb, c, *i: (b, c, 0, 0))

    def seq_row(self):
        """Document ids (b, c, 1, k) of the chunk."""
        return pl.BlockSpec((None, None, 1, self.k), lambda b, hb, c, *i: (b, c, 0, 0))

    def state(self, p, n):
        """The chunk's (hb, p, n) states of a (b, c, h, p, n) array."""
        return pl.BlockSpec((None, None, self.hb, p, n), lambda b, hb, c, *i: (b, c, hb, 0, 0))

    def scalar(self):
        """D of this program's heads, stored (h, 1, 1)."""
        return pl.BlockSpec((self.hb, 1, 1), lambda b, hb, c, *i: (hb, 0, 0))
