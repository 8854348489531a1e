"""The released state-spaces Mamba and Mamba-2 architectures (Pile, GPT-NeoX tokenizer):
`configs/released.py:<name>`, e.g. `configs/released.py:mamba2_130m`; the names are in NAMES."""

from hax_jax.config import Config, ModelConfig

# name -> (mixer, d_model, n_layer). Both keep mamba_ssm's defaults otherwise: Mamba-2 d_state 128,
# headdim 64; tied embeddings; vocab 50277 padded to 50280 (Mamba-1) or 50288 (Mamba-2).
SIZES = {
    "mamba_130m": ("mamba", 768, 24),
    "mamba_370m": ("mamba", 1024, 48),
    "mamba_790m": ("mamba", 1536, 48),
    "mamba_1_4b": ("mamba", 2048, 48),
    "mamba_2_8b": ("mamba", 2560, 64),
    "mamba2_130m": ("mamba2", 768, 24),
    "mamba2_370m": ("mamba2", 1024, 48),
    "mamba2_780m": ("mamba2", 1536, 48),
    "mamba2_1_3b": ("mamba2", 2048, 48),
    "mamba2_2_7b": ("mamba2", 2560, 64),
}
NAMES = tuple(SIZES)
PAD_VOCAB_MULTIPLE = {"mamba": 8, "mamba2": 16}


def get_config(name: str = "mamba2_130m") -> Config:
    """The released model `name` (state-spaces/<name with - and .>, e.g. mamba2-1.3b)."""
    if name not in SIZES:
        raise ValueError(f"unknown released model {name!r}; known: {NAMES}")
    mixer, d_model, n_layer = SIZES[name]
    return Config(
        model=ModelConfig(
            d_model=d_model,
            n_layer=n_layer,
            vocab_size=50277,
            pad_vocab_size_multiple=PAD_VOCAB_MULTIPLE[mixer],
            block_pattern=(mixer,),
        )
    )
