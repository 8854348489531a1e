"""HAX continual pre-training of a released Mamba (HAX paper §5.2, App. D.2).

Convert the checkpoint first (`python -m hax_jax.convert mamba-130m-hf out/mamba-130m`), then
`python train.py configs/continual_pretraining.py train.init_from=out/mamba-130m
data.path=tokens.bin`. `configs/continual_pretraining.py:790m` gives the 790M model and its peak lr.
Every parameter of the checkpoint is loaded; the new HAX branch starts from its init, its q/k
projections from the SSM's B/C.
"""

import dataclasses
from pathlib import Path

from hax_jax.config import DataConfig, OptimConfig, SparseConfig, TrainConfig, load_config_file

PEAK_LR = {"130m": 3e-4, "790m": 1.5e-4}  # App. D.2


def get_config(size: str = "130m"):
    """Mamba + lsh+ks (64 keys); 200 steps at lr 0, 800 of warmup, cosine to 1e-5; batch 64 x 2K."""
    if size not in PEAK_LR:
        raise ValueError(f"unknown size {size!r}; known: {tuple(PEAK_LR)}")
    cfg = load_config_file(f"{Path(__file__).with_name('released.py')}:mamba_{size}")
    model = dataclasses.replace(
        cfg.model,
        dtype="bfloat16",
        sparse=SparseConfig(pattern="lsh+ks", num_keys=64, max_len=2048),
    )
    return dataclasses.replace(
        cfg,
        model=model,
        data=DataConfig(task="tokens", seq_len=2048, batch_size=64, document_boundaries=False),
        optim=OptimConfig(
            schedule="warmup_cosine",
            peak_lr=PEAK_LR[size],
            hold_steps=200,
            warmup_steps=800,
            end_lr=1e-5,
        ),
        train=TrainConfig(num_steps=50_000, log_every=50, eval_every=1000, checkpoint_every=1000),
    )
