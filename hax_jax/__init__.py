"""hax-jax: Mamba, Mamba-2 and HAX sparse-attention hybrids in JAX / Flax NNX."""

from hax_jax.checkpoint import load_pretrained, save_pretrained
from hax_jax.config import Config, Mamba2Config, MambaConfig, ModelConfig
from hax_jax.models.lm import LanguageModel

__all__ = [
    "Config",
    "LanguageModel",
    "Mamba2Config",
    "MambaConfig",
    "ModelConfig",
    "load_pretrained",
    "save_pretrained",
]
