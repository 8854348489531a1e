"""The cases bench/train_throughput.py (and the benches built on it) run: train.py's arguments
for each, and the random token file an LM case reads."""

from pathlib import Path

import numpy as np

import train

ROOT = Path(__file__).parents[1]

LM = ["data.batch_size=8", "data.seq_len=2048"]
BIG_LM = ["model.dtype=bfloat16", "data.task=tokens", "data.document_boundaries=false"]
CASES = {
    "jr_mamba2_hax": ["configs/joint_recall.py:mamba2,hax"],
    "jr_mamba2_none": ["configs/joint_recall.py:mamba2,none"],
    "jr_mamba_hax": ["configs/joint_recall.py:mamba,hax"],
    "lm_mamba2_130m": ["configs/hax_130m.py", "model.sparse.pattern=", *LM],
    "lm_hax_mamba2_130m": ["configs/hax_130m.py", *LM],
    "lm_mamba2_130m_b1": ["configs/hax_130m.py", "model.sparse.pattern=", *LM, "data.batch_size=1"],
    # Long rows, one per step (sequence parallelism: add --set mesh.data=1 mesh.seq=2).
    "lm_mamba2_130m_32k": [
        "configs/hax_130m.py",
        "model.sparse.pattern=",
        "data.batch_size=1",
        "data.seq_len=32768",
    ],
    "lm_hax_mamba2_130m_64k": ["configs/hax_130m.py", "data.batch_size=1", "data.seq_len=65536"],
    # The released Mamba-2 1.3B / 2.7B architectures, as LMs on 2048-token rows (tensor=2: issue
    # 18).
    "lm_mamba2_1_3b": ["configs/released.py:mamba2_1_3b", *BIG_LM, *LM],
    "lm_mamba2_2_7b": ["configs/released.py:mamba2_2_7b", *BIG_LM, *LM],
    # The released Mamba-1 architectures (issue 20's peer: bench/train_step_mamba_ssm.py).
    "lm_mamba_130m": ["configs/released.py:mamba_130m", *BIG_LM, *LM],
    "lm_mamba_1_4b": ["configs/released.py:mamba_1_4b", *BIG_LM, *LM],
    "lm_mamba_2_8b": ["configs/released.py:mamba_2_8b", *BIG_LM, *LM],
    # The same models on the pure-JAX paths (impl="auto" takes the Pallas kernels on a GPU).
    "lm_mamba2_130m_purejax": [
        "configs/hax_130m.py",
        "model.sparse.pattern=",
        *LM,
        "model.mamba2.ssd_impl=chunked",
    ],
    "lm_hax_mamba2_130m_purejax": [
        "configs/hax_130m.py",
        *LM,
        "model.mamba2.ssd_impl=chunked",
        "model.sparse.impl=indexed",
    ],
}


def token_file(directory: Path, vocab_size: int, seq_len: int) -> str:
    """A random token stream (uint32 .npy) for the LM cases: 64 rows of 2048 tokens, or 4 rows
    of `seq_len` (one of them held out) where that is more."""
    size = max(8 * 2048 * 64, 4 * (seq_len + 1)) + 1
    path = directory / f"tokens_{size}.npy"
    if not path.exists():
        rng = np.random.default_rng(0)
        np.save(path, rng.integers(1, vocab_size, size, dtype=np.uint32))
    return str(path)


def case_argv(name: str, extra, scratch: Path) -> list[str]:
    """train.py's arguments for case `name` with `extra` overrides; an LM case reads a random
    token file in `scratch` long enough for its resolved data.seq_len."""
    argv = [str(ROOT / CASES[name][0]), *CASES[name][1:], *extra, "train.progress=false"]
    if name.startswith("lm_"):
        seq_len = train.resolve_config(argv).data.seq_len
        argv.append(f"data.path={token_file(scratch, 50277, seq_len)}")
    return argv
