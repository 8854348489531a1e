"""Tuning knobs of the Pallas SSD: rows per tile, heads per backward program, Triton warps,
and whether the chunk_state / chunk_out kernels are the Mosaic GPU ones."""

import dataclasses

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
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value <= 0):  # fmt: skip
            raise ValueError(f"block_sizes.{name} must be a positive int, got {value!r}")
    tile = min(chunk_size, _TILE[variant])
    sizes = BlockSizes(
        tile=sizes.tile or tile,
        tile_bwd=sizes.tile_bwd or tile,
        heads_per_block=sizes.heads_per_block or _default_heads_per_block(heads_per_group),
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
    if heads_per_group % sizes.heads_per_block:
        raise ValueError(
            f"block_sizes.heads_per_block must divide the heads per group = {heads_per_group}, "
            f"got {sizes.heads_per_block}"
        )
    return sizes
