"""The released state-spaces/mamba-1.4b architecture (Pile, GPT-NeoX tokenizer)."""

from hax_jax.config import Config, ModelConfig


def get_config() -> Config:
    """Mamba-1, d_model=2048, 48 layers, vocab 50277 padded to 50280, tied embeddings."""
    return Config(
        model=ModelConfig(
            d_model=2048,
            n_layer=48,
            vocab_size=50277,
            pad_vocab_size_multiple=8,
            block_pattern=("mamba",),
        )
    )
