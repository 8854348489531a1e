"""hax-jax: Mamba, Mamba-2 and HAX sparse-attention hybrids in JAX / Flax NNX."""

from hax_jax.checkpoint import load_pretrained, save_pretrained
from hax_jax.config import Config, Mamba2Config, MambaConfig, ModelConfig, SparseConfig
from hax_jax.generate import Generation, generate
from hax_jax.models.lm import LanguageModel
from pallas_kernels.sparse_attention import sparse_attention

__all__ = [
    "Config",
    "Generation",
    "LanguageModel",
    "Mamba2Config",
    "MambaConfig",
    "ModelConfig",
    "SparseConfig",
    "generate",
    "load_pretrained",
    "save_pretrained",
    "sparse_attention",
]
