"""Generated evaluation splits kept on disk, so that each is drawn once per machine.

Joint recall draws its valid and test examples by rejection (~100 candidates an example, ~6 ms):
14,400 of them took every train.py a minute of CPU at its first evaluation and every eval.py
another, while the GPU waited. A split is a pure function of its parameters and of the
generator's code, so its arrays are stored under a key of both: the first process to need them
builds them while the others wait on its lock, and every later process (a resumed run, eval.py,
the other runs of a sweep) reads the file.
"""

import fcntl
import hashlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np


def directory() -> Path:
    """Where splits are kept: $HAX_JAX_CACHE, else $XDG_CACHE_HOME/hax_jax (~/.cache/hax_jax)."""
    if os.environ.get("HAX_JAX_CACHE"):
        return Path(os.environ["HAX_JAX_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hax_jax"


def key(name: str, params: dict, *code: Path) -> str:
    """A file name for the split made by the files `code` (their source bytes, in order) from
    `params` (JSON-able)."""
    if not code:
        raise ValueError("split_cache.key needs the source files that make the split")
    digest = hashlib.blake2b(digest_size=16)
    for path in code:
        digest.update(path.read_bytes())
    digest.update(json.dumps(params, sort_keys=True).encode())
    return f"{name}-{digest.hexdigest()}"


def load_or_build(
    name: str, build: Callable[[], dict[str, np.ndarray]], where: Path | None = None
) -> dict[str, np.ndarray]:
    """The arrays stored as `name` in `where` (default: directory()), built and stored first by
    whichever process gets there first."""
    where = where or directory()
    path = where / f"{name}.npz"
    if not path.exists():
        try:
            where.mkdir(parents=True, exist_ok=True)
            lock = open(where / f"{name}.lock", "w")  # closed by the with below
        except OSError as err:  # an unwritable cache costs time, not the run
            print(
                f"warning: {err}; drawing {name} without keeping it (set HAX_JAX_CACHE)",
                file=sys.stderr,
            )
            return build()
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if not path.exists():  # not built while this process waited
                partial = where / f"{name}.{os.getpid()}.partial.npz"
                np.savez(partial, **build())
                os.replace(partial, path)  # whole or absent: readers never see half a file
    with np.load(path) as stored:
        return {k: stored[k] for k in stored.files}
