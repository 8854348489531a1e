"""The main job: HAX (lsh+ks) on Mamba-2, on a joint recall small enough for one CPU in minutes.

The paper's grid cell `configs/joint_recall.py:mamba2,hax` with fewer contexts and keys (up to 4 x
4, so sequences of 73 tokens instead of 1057), a shorter warmup and fewer steps. Chance accuracy is
1/16.
"""

import dataclasses
from pathlib import Path

from hax_jax.config import DataConfig, JointRecallConfig, OptimConfig, TrainConfig, load_config_file


def get_config():
    """The default of `python train.py`."""
    cfg = load_config_file(f"{Path(__file__).with_name('joint_recall.py')}:mamba2,hax")
    model = cfg.model
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(
            model,
            mamba2=dataclasses.replace(model.mamba2, chunk_size=32),
            sparse=dataclasses.replace(model.sparse, num_keys=16, max_len=74),
        ),
        data=DataConfig(
            task="joint_recall",
            batch_size=32,
            joint_recall=JointRecallConfig(
                n_context=(2, 4),
                n_key=(2, 4),
                max_n_context=4,
                max_n_key=4,
                valid_size=512,
            ),
        ),
        optim=OptimConfig(peak_lr=2e-3, warmup_steps=200),
        train=TrainConfig(num_steps=2000, log_every=50, eval_every=500, checkpoint_every=500),
    )
