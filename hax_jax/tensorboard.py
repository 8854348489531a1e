"""TensorBoard scalar event files, written and read without TensorFlow or tensorboard installed.

An event file is a sequence of TFRecords, each holding one serialized `Event` protobuf. We only
need three small messages, so they are encoded by hand (field numbers from TensorFlow's
`event.proto` and `summary.proto`):

    Event   {double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5}
    Summary {repeated Value value = 1}
    Value   {string tag = 1; float simple_value = 2}

TFRecord framing: uint64 length (LE), masked crc32c(length), data, masked crc32c(data).
"""

import math
import os
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Self

FILE_VERSION = "brain.Event:2"

# Protobuf wire types.
_VARINT, _FIXED64, _BYTES, _FIXED32 = 0, 1, 2, 5


def _crc32c_table() -> tuple[int, ...]:
    """The 256-entry lookup table of the reflected Castagnoli polynomial 0x82F63B78."""
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return tuple(table)


_CRC32C_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of `data`, one table lookup per byte."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> int:
    """TFRecord's masked crc32c: rotated and offset so CRCs of CRC-bearing data stay strong."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _record(data: bytes) -> bytes:
    """`data` framed as one TFRecord."""
    length = struct.pack("<Q", len(data))
    return (
        length
        + struct.pack("<I", _masked_crc(length))
        + data
        + struct.pack("<I", _masked_crc(data))
    )


def _varint(n: int) -> bytes:
    """Base-128 varint of `n`; negatives as 64-bit two's complement, as protobuf's int64 does."""
    n &= 0xFFFFFFFFFFFFFFFF
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    """The tag that precedes a protobuf field."""
    return _varint(field << 3 | wire_type)


def _len_delimited(field: int, payload: bytes) -> bytes:
    """A length-delimited (string, bytes or sub-message) protobuf field."""
    return _key(field, _BYTES) + _varint(len(payload)) + payload


def _float32(value: float) -> bytes:
    """`value` as a little-endian float32; beyond float32's range it saturates to +-inf."""
    try:
        return struct.pack("<f", value)
    except OverflowError:  # a diverging loss must not crash the logging, so log it as inf
        return struct.pack("<f", math.copysign(math.inf, value))


def _event(*, step: int = 0, file_version: str = "", summary: bytes = b"") -> bytes:
    """A serialized Event stamped with the current wall time."""
    out = _key(1, _FIXED64) + struct.pack("<d", time.time())
    if step:  # proto3 omits a zero step, so our bytes match protobuf's own serializer
        out += _key(2, _VARINT) + _varint(step)
    if file_version:
        out += _len_delimited(3, file_version.encode())
    if summary:
        out += _len_delimited(5, summary)
    return out


def _scalar_summary(tag: str, value: float) -> bytes:
    """A serialized Summary with one simple_value."""
    value_msg = _len_delimited(1, tag.encode()) + _key(2, _FIXED32) + _float32(value)
    return _len_delimited(1, value_msg)


class SummaryWriter:
    """Appends scalar summaries to a new event file in `logdir`; readable by TensorBoard."""

    def __init__(self, logdir: str | Path):
        """Creates `logdir` and a new event file in it, starting with the file_version event."""
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        # A resumed run gets a new file beside the old ones (TensorBoard reads them all); the pid keeps
        # two writers started within the same second apart, and "x" refuses to share a file anyway.
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
        self.path = self.logdir / name
        for n in range(1, 1000):
            if not self.path.exists():
                break
            self.path = self.logdir / f"{name}.{n}"
        self._file = open(self.path, "xb")  # noqa: SIM115 (the writer outlives __init__)
        self._file.write(_record(_event(file_version=FILE_VERSION)))

    def scalar(self, tag: str, value: float, step: int) -> None:
        """Records `value` (anything `float()` accepts, e.g. a jax scalar) under `tag` at `step`."""
        summary = _scalar_summary(tag, float(value))
        self._file.write(_record(_event(step=int(step), summary=summary)))

    def flush(self) -> None:
        """Pushes buffered events to the OS, so a running TensorBoard sees them."""
        self._file.flush()

    def close(self) -> None:
        """Flushes and closes the file; later calls are no-ops."""
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> Self:
        """Returns the writer itself."""
        return self

    def __exit__(self, *exc_info) -> None:
        """Closes the writer."""
        self.close()


def _records(data: bytes) -> Iterator[bytes]:
    """The payloads of the TFRecords in `data`, each checked against both of its CRCs."""
    pos = 0
    while pos < len(data):
        if len(data) - pos < 12:
            raise ValueError(f"truncated record header at byte {pos}")
        header, (header_crc,) = data[pos : pos + 8], struct.unpack_from("<I", data, pos + 8)
        if _masked_crc(header) != header_crc:
            raise ValueError(f"length crc mismatch in the record at byte {pos}")
        (length,) = struct.unpack("<Q", header)
        end = pos + 12 + length
        if len(data) < end + 4:
            raise ValueError(f"truncated record at byte {pos}: {length=}")
        payload, (payload_crc,) = data[pos + 12 : end], struct.unpack_from("<I", data, end)
        if _masked_crc(payload) != payload_crc:
            raise ValueError(f"data crc mismatch in the record at byte {pos}")
        yield payload
        pos = end + 4


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    """The varint at `buf[pos:]` and the position after it."""
    n = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        byte = buf[pos]
        n |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return n, pos
        shift += 7


def _fields(buf: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of each protobuf field in `buf`: ints for varints, else raw bytes."""
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        field, wire_type = key >> 3, key & 7
        if wire_type == _VARINT:
            value, pos = _read_varint(buf, pos)
        elif wire_type in (_FIXED64, _FIXED32):
            size = 8 if wire_type == _FIXED64 else 4
            value, pos = buf[pos : pos + size], pos + size
        elif wire_type == _BYTES:
            size, pos = _read_varint(buf, pos)
            value, pos = buf[pos : pos + size], pos + size
        else:
            raise ValueError(f"unsupported protobuf {wire_type=} for {field=}")
        if pos > len(buf):
            raise ValueError(f"truncated protobuf {field=}")
        yield field, value


def read_scalars(path: str | Path) -> list[tuple[int, str, float]]:
    """(step, tag, value) of every simple_value in the event file `path`, in file order.

    Args:
      path: one `events.out.tfevents.*` file.

    Returns:
      The scalars; values carry float32 precision, as stored.

    Raises:
      ValueError: a record is truncated or fails its CRC, or a protobuf is malformed.
    """
    scalars = []
    for event in _records(Path(path).read_bytes()):
        step, summaries = 0, []
        for field, value in _fields(event):
            if field == 2:
                step = value - (1 << 64) if value >= 1 << 63 else value  # int64 two's complement
            elif field == 5:
                summaries.append(value)
        for summary in summaries:
            for field, value_msg in _fields(summary):
                if field != 1:
                    continue
                tag, simple_value = "", None
                for value_field, value in _fields(value_msg):
                    if value_field == 1:
                        tag = value.decode()
                    elif value_field == 2:
                        (simple_value,) = struct.unpack("<f", value)
                # Images, histograms and tensor summaries have no simple_value; they are skipped.
                if simple_value is not None:
                    scalars.append((step, tag, simple_value))
    return scalars
