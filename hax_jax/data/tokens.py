"""Token files, memory-mapped and packed into fixed rows with document boundaries.

A token file is a flat stream of token ids whose documents each end with `eos_id`: a raw `.bin`
(uint16 or uint32, the dtype given) or a `.npy` (its own integer dtype). Row i covers tokens [i L, i
L + L + 1): inputs are its first L, labels its last L (neighbouring rows share one token). seq_idx
counts the eos tokens before each position, so a new document starts right after an eos; real and
loss_mask are all ones. Token ids are checked against vocab_size lazily, per row read (a whole-file
max would read every byte at start-up), and eagerly on the first row so that a wrong vocabulary
fails at once.
"""

from pathlib import Path

import numpy as np

RAW_DTYPES = ("uint16", "uint32")


def open_tokens(path: str | Path, dtype: str = "uint16") -> np.ndarray:
    """The token stream of a .npy (dtype from the file) or raw file (dtype given), memory-mapped."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"token file {str(path)!r} does not exist")
    if path.suffix == ".npy":
        tokens = np.load(path, mmap_mode="r")
        if tokens.ndim != 1 or tokens.dtype.kind not in "ui":
            raise ValueError(
                f"token file {str(path)!r} holds a {tokens.dtype} array of shape {tokens.shape}; "
                "expected a flat integer stream"
            )
        return tokens
    if dtype not in RAW_DTYPES:
        raise ValueError(f"token dtype {dtype!r} of {str(path)!r} must be one of {RAW_DTYPES}")
    size, itemsize = path.stat().st_size, np.dtype(dtype).itemsize
    if size % itemsize:
        raise ValueError(
            f"token file {str(path)!r} has {size} bytes, not a multiple of {dtype}'s {itemsize}"
        )
    if size == 0:
        return np.zeros(0, dtype)  # np.memmap refuses empty files; the row check reports it
    return np.memmap(path, dtype=dtype, mode="r")


def num_rows(num_tokens: int, seq_len: int) -> int:
    """Rows of seq_len inputs (plus one label token) that a stream of num_tokens fills."""
    return max(num_tokens - 1, 0) // seq_len


def split_rows(n_rows: int, valid_fraction: float) -> dict[str, tuple[int, int]]:
    """Row ranges of a file split into train and its last valid_fraction (at least one row each)."""
    n_valid = max(1, round(n_rows * valid_fraction))
    if n_rows - n_valid < 1:
        raise ValueError(
            f"{n_rows} rows leave no training rows after valid_fraction={valid_fraction}"
        )
    return {"train": (0, n_rows - n_valid), "valid": (n_rows - n_valid, n_rows)}


class TokenSource:
    """A grain random-access source over the rows [start, stop) of a token file."""

    def __init__(
        self,
        path: str | Path,
        *,
        seq_len: int,
        vocab_size: int,
        eos_id: int = 0,
        dtype: str = "uint16",
        rows: tuple[int, int] | None = None,
    ):
        if not 0 <= eos_id < vocab_size:
            raise ValueError(f"eos_id={eos_id} must be in [0, vocab_size={vocab_size})")
        self.path, self.tokens = str(path), open_tokens(path, dtype)
        self.seq_len, self.vocab_size, self.eos_id = seq_len, vocab_size, eos_id
        total = num_rows(len(self.tokens), seq_len)
        if total < 1:
            raise ValueError(
                f"token file {self.path!r} has {len(self.tokens)} tokens, fewer than one row of "
                f"seq_len + 1 = {seq_len + 1}"
            )
        self.start, self.stop = rows if rows is not None else (0, total)
        if not 0 <= self.start < self.stop <= total:
            raise ValueError(f"rows={rows} must lie within the file's {total} rows")
        self[0]  # a wrong vocabulary or dtype fails here, not steps into training

    def __len__(self) -> int:
        """The number of rows."""
        return self.stop - self.start

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        """Row `index` of this range in the training schema, each (seq_len,) int32."""
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} rows of {self.path!r}")
        begin = (self.start + index) * self.seq_len
        row = np.asarray(self.tokens[begin : begin + self.seq_len + 1]).astype(np.int64)
        bad = np.flatnonzero((row < 0) | (row >= self.vocab_size))
        if bad.size:
            raise ValueError(
                f"token id {row[bad[0]]} at position {begin + bad[0]} of {self.path!r} is outside "
                f"[0, vocab_size={self.vocab_size})"
            )
        inputs = row[:-1].astype(np.int32)
        seq_idx = np.concatenate([[0], np.cumsum(inputs[:-1] == self.eos_id)]).astype(np.int32)
        return {
            "inputs": inputs,
            "labels": row[1:].astype(np.int32),
            "loss_mask": np.ones(self.seq_len, np.int32),
            "real": np.ones(self.seq_len, np.int32),
            "seq_idx": seq_idx,
        }


def token_source(
    path: str | Path,
    split: str,
    *,
    seq_len: int,
    vocab_size: int,
    eos_id: int = 0,
    dtype: str = "uint16",
    valid_path: str | Path = "",
    valid_fraction: float = 0.01,
) -> TokenSource:
    """The train or valid rows: the valid file if given, else the last valid_fraction of `path`."""
    if split not in ("train", "valid"):
        raise ValueError(f"unknown split {split!r} for token files; known: ('train', 'valid')")
    args = {"seq_len": seq_len, "vocab_size": vocab_size, "eos_id": eos_id, "dtype": dtype}
    if valid_path:
        return TokenSource(valid_path if split == "valid" else path, **args)
    total = len(TokenSource(path, **args))  # checks the file
    if total < 2:
        raise ValueError(
            f"token file {str(path)!r} has {total} rows of seq_len={seq_len}; a train/valid split "
            "needs at least 2 (or give a valid file)"
        )
    return TokenSource(path, rows=split_rows(total, valid_fraction)[split], **args)
