"""A tiny Mamba-2 / Mamba hybrid that runs anywhere in seconds (smoke runs, tests)."""

from hax_jax.config import Config, Mamba2Config, ModelConfig


def get_config() -> Config:
    """Two Mamba-2 layers and two Mamba layers, d_model 64, the joint-recall vocabulary (100)."""
    return Config(
        model=ModelConfig(
            d_model=64,
            n_layer=4,
            vocab_size=100,
            block_pattern=("mamba2", "mamba"),
            mamba2=Mamba2Config(d_state=16, headdim=16, chunk_size=64),
        )
    )
