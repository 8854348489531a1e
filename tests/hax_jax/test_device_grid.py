"""The mesh's device layout (sharding.device_grid) on the machines CI cannot have, with stand-in
devices: several TPU slices put "data" across slices and nothing else; one TPU slice follows its
torus; GPUs go by id; CPUs as given."""

import dataclasses

import numpy as np
import pytest

from hax_jax.sharding import device_grid


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    """What jax's mesh_utils reads of a device."""

    id: int
    platform: str
    coords: tuple[int, int, int] = (0, 0, 0)
    slice_index: int = 0
    core_on_chip: int = 0
    device_kind: str = "stand-in"
    process_index: int = 0


def _tpu_slices(slices: int, x: int, y: int) -> np.ndarray:
    """`slices` TPU slices of x * y chips each, listed with the slices interleaved (so a layout
    that keeps the given order mixes them)."""
    devices = [
        FakeDevice(id=s * x * y + j * x + i, platform="tpu", coords=(i, j, 0), slice_index=s)
        for j in range(y)
        for i in range(x)
        for s in range(slices)
    ]
    return np.asarray(devices, dtype=object)


def test_data_spans_tpu_slices_and_nothing_else():
    grid = device_grid(_tpu_slices(2, 2, 2), (4, 1, 2))
    slice_of = np.vectorize(lambda d: d.slice_index)(grid)
    assert grid.shape == (4, 1, 2)
    # Each slice is a contiguous block of the data axis; seq and tensor stay inside a slice.
    assert (slice_of[:2] == 0).all() and (slice_of[2:] == 1).all()
    assert sorted(d.id for d in grid.flat) == list(range(8))


def test_a_data_axis_the_slices_do_not_divide_is_refused():
    with pytest.raises(ValueError, match=r"mesh.data=1 must be a multiple of the 2 TPU slices"):
        device_grid(_tpu_slices(2, 2, 2), (1, 2, 4))


def test_one_tpu_slice_follows_its_torus():
    devices = _tpu_slices(1, 2, 4)
    grid = device_grid(devices, (2, 1, 4))
    coords = np.vectorize(lambda d: d.coords[0] + 10 * d.coords[1])(grid)
    # Tensor neighbours are torus neighbours: one coordinate apart.
    steps = np.abs(np.diff(coords, axis=-1))
    assert ((steps == 1) | (steps == 10)).all()
    assert sorted(d.id for d in grid.flat) == list(range(8))


def test_gpus_go_by_id_and_cpus_as_given():
    gpus = np.asarray([FakeDevice(id=i, platform="gpu") for i in (3, 1, 2, 0)], dtype=object)
    assert [d.id for d in device_grid(gpus, (2, 1, 2)).flat] == [0, 1, 2, 3]
    cpus = np.asarray([FakeDevice(id=i, platform="cpu") for i in (3, 1, 2, 0)], dtype=object)
    assert [d.id for d in device_grid(cpus, (2, 1, 2)).flat] == [3, 1, 2, 0]
