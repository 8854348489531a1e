"""Event files: crc32c vectors, write/read round trips, and CRC checks on corrupted files."""

import random
import struct

import jax.numpy as jnp
import pytest

from hax_jax.tensorboard import FILE_VERSION, SummaryWriter, crc32c, read_scalars


def crc32c_bitwise(data: bytes) -> int:
    """The slow twin of `crc32c`: one polynomial step per bit, no table."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 * (crc & 1))
    return crc ^ 0xFFFFFFFF


@pytest.mark.parametrize(
    "data, expected",
    [
        (b"", 0),
        (b"123456789", 0xE3069283),  # the CRC catalogue's check value
        (bytes(32), 0x8A9136AA),  # RFC 3720 (iSCSI) B.4
        (b"\xff" * 32, 0x62A8AB43),  # RFC 3720 B.4
        (bytes(range(32)), 0x46DD794E),  # RFC 3720 B.4
    ],
)
def test_crc32c_known_vectors(data, expected):
    """The table-driven CRC matches published CRC-32C vectors."""
    assert crc32c(data) == expected


def test_crc32c_matches_bitwise_twin():
    """Table lookups agree with the bit-by-bit definition on random payloads."""
    rng = random.Random(0)
    for size in (1, 7, 64, 1000):
        data = rng.randbytes(size)
        assert crc32c(data) == crc32c_bitwise(data)


def test_scalars_round_trip(tmp_path):
    """Scalars written in order are read back in order, at float32 precision."""
    written = [(0, "loss", 2.5), (0, "lr", 1e-3), (1, "loss", 2.25), (2**40, "tokens", 3.0)]
    written.append((-1, "eval/negative step", float("-inf")))
    with SummaryWriter(tmp_path / "train") as writer:
        for step, tag, value in written:
            writer.scalar(tag, value, step)
        writer.scalar("jax scalar", jnp.float32(0.5), step=jnp.int32(3))
        writer.scalar("overflow", 1e300, 4)
    expected = [(s, t, struct.unpack("<f", struct.pack("<f", v))[0]) for s, t, v in written]
    expected += [(3, "jax scalar", 0.5), (4, "overflow", float("inf"))]
    assert read_scalars(writer.path) == expected


def test_file_name_and_version_record(tmp_path):
    """One file named like TensorBoard's, starting with the file_version event."""
    SummaryWriter(tmp_path).close()
    (path,) = tmp_path.iterdir()
    assert path.name.startswith("events.out.tfevents.")
    data = path.read_bytes()
    (length,) = struct.unpack_from("<Q", data)
    assert FILE_VERSION.encode() in data[12 : 12 + length]
    assert len(data) == 12 + length + 4
    assert read_scalars(path) == []


def test_flush_makes_events_visible(tmp_path):
    """After flush, a reader sees the scalars while the writer is still open."""
    writer = SummaryWriter(tmp_path)
    writer.scalar("loss", 1.0, 7)
    writer.flush()
    assert read_scalars(writer.path) == [(7, "loss", 1.0)]
    writer.close()
    writer.close()


@pytest.mark.parametrize("where", ["length", "data"])
def test_corrupted_byte_raises(tmp_path, where):
    """Flipping one byte of a record's length or payload fails that record's CRC."""
    with SummaryWriter(tmp_path) as writer:
        writer.scalar("loss", 1.0, 1)
    data = bytearray(writer.path.read_bytes())
    (first_length,) = struct.unpack_from("<Q", data)
    second = 12 + first_length + 4
    offset = second + (0 if where == "length" else 12 + 3)
    data[offset] ^= 0x01
    writer.path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="crc mismatch"):
        read_scalars(writer.path)


def test_truncated_file_raises(tmp_path):
    """A file cut mid-record (e.g. by a crash) is reported, not silently shortened."""
    with SummaryWriter(tmp_path) as writer:
        writer.scalar("loss", 1.0, 1)
    writer.path.write_bytes(writer.path.read_bytes()[:-2])
    with pytest.raises(ValueError, match="truncated"):
        read_scalars(writer.path)
