"""HAX-Mamba-2 130M: the released Mamba-2 130M with an lsh+ks sparse branch in every layer.

For language modelling on a token file: `python train.py configs/hax_130m.py data.path=tokens.bin`.
The sparse branch takes no document boundaries, so rows are plain 2048-token windows (as in HAX
§5.2).
"""

import dataclasses
from pathlib import Path

from hax_jax.config import DataConfig, OptimConfig, SparseConfig, TrainConfig, load_config_file


def get_config():
    """released.py:mamba2_130m + SparseConfig(lsh+ks, 64 keys); AdamW (0.9, 0.95), WD 0.1, cosine to
    1e-5."""
    cfg = load_config_file(f"{Path(__file__).with_name('released.py')}:mamba2_130m")
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
            peak_lr=3e-4,
            hold_steps=200,
            warmup_steps=800,
            end_lr=1e-5,
            b2=0.95,
            weight_decay=0.1,
        ),
        train=TrainConfig(num_steps=50_000, log_every=50, eval_every=1000, checkpoint_every=1000),
    )
