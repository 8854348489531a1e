"""A small Mamba-2 LM on a local text file, with a byte-level BPE trained on it (SPEC §4, §5).

`python train.py configs/text_lm.py` trains on CPython's pydoc help topics (465 K characters of
English, written to runs/data/ on first use); `configs/text_lm.py:<file.txt>` trains on your own
file.
"""

from pathlib import Path

from hax_jax.config import Config, DataConfig, Mamba2Config, ModelConfig, OptimConfig, TrainConfig
from hax_jax.data.text import write_pydoc_topics


def get_config(path: str = "") -> Config:
    """4 Mamba-2 layers of width 128, a 4096-token BPE, rows of 256 tokens packed with seq_idx."""
    if not path:
        path = "runs/data/pydoc_topics.txt"
        if not Path(path).exists():
            write_pydoc_topics(path)
    return Config(
        model=ModelConfig(
            d_model=128,
            n_layer=4,
            vocab_size=4096,
            block_pattern=("mamba2",),
            mamba2=Mamba2Config(d_state=64, headdim=32, chunk_size=64),
        ),
        data=DataConfig(task="text", path=path, seq_len=256, batch_size=16),
        optim=OptimConfig(
            schedule="warmup_cosine",
            peak_lr=3e-3,
            warmup_steps=100,
            end_lr=1e-5,
            b2=0.95,
            weight_decay=0.1,
        ),
        train=TrainConfig(num_steps=2000, log_every=50, eval_every=500, checkpoint_every=500),
    )
