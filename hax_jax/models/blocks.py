"""Pre-norm residual blocks; the mixer of each layer is chosen by name from one table."""

import jax
import jax.numpy as jnp
from flax import nnx

from hax_jax.config import ModelConfig
from hax_jax.layers.attention import Attention, SlidingWindowAttention
from hax_jax.layers.infini import InfiniAttention
from hax_jax.layers.mamba import MambaMixer
from hax_jax.layers.mamba2 import Mamba2Mixer
from hax_jax.layers.mlp import SwiGLU
from hax_jax.layers.norms import RMSNorm

# Every mixer takes (cfg: ModelConfig, *, rngs) and offers __call__(x, *, cache, seq_idx, mask, rng)
# -> (y, cache), step(x_t, cache) -> (y_t, cache) and init_cache(batch). `mask` (b, l) marks real
# tokens; `rng` is given in training only (the sparse branch resamples its hash and ranking-loss
# candidates).
MIXERS = {
    "mamba": MambaMixer,
    "mamba2": Mamba2Mixer,
    "attention": Attention,
    "swa": SlidingWindowAttention,
    "mlp": SwiGLU,
    "infini": InfiniAttention,
}


class ResidualBlock(nnx.Module):
    """x + mixer(norm(x)), with the residual stream in fp32 when cfg.residual_in_fp32."""

    def __init__(self, kind: str, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mixer = MIXERS[kind](cfg, rngs=rngs)
        self.dtype = jnp.dtype(cfg.dtype)

    def __call__(self, x: jax.Array, *, cache=None, seq_idx=None, mask=None, rng=None):
        """Parallel mode: x (b, l, d) -> (x', cache after the last token)."""
        y, cache = self.mixer(
            self.norm(x).astype(self.dtype), cache=cache, seq_idx=seq_idx, mask=mask, rng=rng
        )
        return x + y.astype(x.dtype), cache

    def step(self, x: jax.Array, cache):
        """Recurrent mode: x (b, d) -> (x', cache)."""
        y, cache = self.mixer.step(self.norm(x).astype(self.dtype), cache)
        return x + y.astype(x.dtype), cache
