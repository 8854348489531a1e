"""The released state-spaces/mamba2-1.3b architecture (Pile, GPT-NeoX tokenizer)."""

from hax_jax.config import Config, ModelConfig


def get_config() -> Config:
    """Mamba-2, d_model=2048, 48 layers, d_state 128, headdim 64, vocab 50277 padded to 50288, tied."""
    return Config(
        model=ModelConfig(
            d_model=2048,
            n_layer=48,
            vocab_size=50277,
            pad_vocab_size_multiple=16,
            block_pattern=("mamba2",),
        )
    )
