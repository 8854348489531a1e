"""Token files: packing with document boundaries, .bin and .npy, train/valid split, bad files."""

import numpy as np
import pytest

from hax_jax.data import tokens

# Documents (5, 6), (7, 8, 9), (10, 11, 12, 13), (14, ...) each ended by eos 0.
STREAM = [5, 6, 0, 7, 8, 9, 0, 10, 11, 12, 13, 0, 14, 15, 16, 17, 18, 0, 19, 20, 21]


def write_bin(path, stream, dtype="uint16"):
    """Writes a raw token file."""
    np.asarray(stream, dtype).tofile(path)
    return path


def test_rows_are_packed_with_document_boundaries(tmp_path):
    src = tokens.TokenSource(write_bin(tmp_path / "t.bin", STREAM), seq_len=4, vocab_size=32)
    assert len(src) == (len(STREAM) - 1) // 4 == 5
    row = src[1]  # tokens [4, 9): 8, 9, 0, 10 | 11
    np.testing.assert_array_equal(row["inputs"], [8, 9, 0, 10])
    np.testing.assert_array_equal(row["labels"], [9, 0, 10, 11])
    np.testing.assert_array_equal(row["seq_idx"], [0, 0, 0, 1])  # a new document after the eos
    assert row["real"].all() and row["loss_mask"].all()
    np.testing.assert_array_equal(src[0]["seq_idx"], [0, 0, 0, 1])  # 5, 6, 0, 7
    np.testing.assert_array_equal(src[2]["seq_idx"], [0, 0, 0, 0])  # 11, 12, 13, 0
    np.testing.assert_array_equal(src[4]["inputs"], [18, 0, 19, 20])
    np.testing.assert_array_equal(src[4]["seq_idx"], [0, 0, 1, 1])
    assert all(v.dtype == np.int32 and v.shape == (4,) for v in row.values())
    with pytest.raises(IndexError, match="index 5 out of range"):
        src[5]


def test_npy_and_uint32_files(tmp_path):
    np.save(tmp_path / "t.npy", np.asarray(STREAM, np.int32))
    a = tokens.TokenSource(tmp_path / "t.npy", seq_len=4, vocab_size=32)
    big = [t + 70_000 if t else 0 for t in STREAM]
    b = tokens.TokenSource(
        write_bin(tmp_path / "t32.bin", big, "uint32"), seq_len=4, vocab_size=80_000, dtype="uint32"
    )
    np.testing.assert_array_equal(a[1]["inputs"], [8, 9, 0, 10])
    np.testing.assert_array_equal(b[1]["inputs"], [70_008, 70_009, 0, 70_010])
    np.testing.assert_array_equal(b[1]["seq_idx"], [0, 0, 0, 1])


def test_train_valid_split(tmp_path):
    path = write_bin(tmp_path / "t.bin", STREAM)
    args = {"seq_len": 4, "vocab_size": 32, "valid_fraction": 0.4}
    train, valid = (
        tokens.token_source(path, "train", **args),
        tokens.token_source(path, "valid", **args),
    )
    assert (len(train), len(valid)) == (3, 2)  # 5 rows, the last 2 held out
    np.testing.assert_array_equal(
        valid[0]["inputs"], tokens.TokenSource(path, seq_len=4, vocab_size=32)[3]["inputs"]
    )
    other = write_bin(tmp_path / "v.bin", STREAM[:9])
    valid_file = tokens.token_source(path, "valid", valid_path=other, **args)
    assert (
        len(valid_file) == 2
        and len(tokens.token_source(path, "train", valid_path=other, **args)) == 5
    )
    with pytest.raises(ValueError, match="unknown split 'test'"):
        tokens.token_source(path, "test", **args)


def test_bad_files_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.bin"):
        tokens.TokenSource(tmp_path / "missing.bin", seq_len=4, vocab_size=32)
    short = write_bin(tmp_path / "short.bin", STREAM[:4])
    with pytest.raises(ValueError, match="4 tokens, fewer than one row of seq_len \\+ 1 = 5"):
        tokens.TokenSource(short, seq_len=4, vocab_size=32)
    with pytest.raises(ValueError, match="token dtype 'int8'"):
        tokens.TokenSource(tmp_path / "short.bin", seq_len=2, vocab_size=32, dtype="int8")
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(ValueError, match="3 bytes, not a multiple"):
        tokens.TokenSource(tmp_path / "odd.bin", seq_len=1, vocab_size=32)
    np.save(tmp_path / "f.npy", np.zeros(10, np.float32))
    with pytest.raises(ValueError, match="float32 array"):
        tokens.TokenSource(tmp_path / "f.npy", seq_len=2, vocab_size=32)
    # Ids are checked per row read: row 0 at once, a bad id in row 3 when row 3 is read.
    with pytest.raises(ValueError, match="token id 7 at position 3 .* vocab_size=7"):
        tokens.TokenSource(tmp_path / "short.bin", seq_len=3, vocab_size=7)
    bad = write_bin(tmp_path / "bad.bin", STREAM[:13] + [40] + STREAM[14:])
    src = tokens.TokenSource(bad, seq_len=4, vocab_size=32)
    src[2]
    with pytest.raises(ValueError, match="token id 40 at position 13"):
        src[3]
    with pytest.raises(ValueError, match="eos_id=32 must be in"):
        tokens.TokenSource(bad, seq_len=4, vocab_size=32, eos_id=32)
