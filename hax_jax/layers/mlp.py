"""The SwiGLU MLP mixer ("mlp"): down(silu(gate(x)) * up(x)); position-wise, no state kept."""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from hax_jax.config import DEFAULT_CAPACITY, ModelConfig
from hax_jax.layers import init


class MlpCache(NamedTuple):
    """The MLP's (empty) decode state, so the blocks' cache plumbing treats every mixer alike."""


def mlp_hidden_dim(cfg: ModelConfig) -> int:
    """cfg.mlp.d_ff, else 2/3 * hidden_ratio * d_model rounded up to a multiple of 256."""
    if cfg.mlp.d_ff is not None:
        return cfg.mlp.d_ff
    return 256 * math.ceil(2 / 3 * cfg.mlp.hidden_ratio * cfg.d_model / 256)


class SwiGLU(nnx.Module):
    """gate/up projections d -> d_ff, SiLU(gate) * up, down projection d_ff -> d; no biases."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, f = cfg.d_model, mlp_hidden_dim(cfg)
        self.dtype = jnp.dtype(cfg.dtype)

        linear = functools.partial(init.linear, rngs=rngs, dtype=self.dtype)

        # Megatron layout: d_ff split over "tensor", one all-reduce after down_proj.
        self.gate_proj = linear(d, f, ("embed", "mlp"))
        self.up_proj = linear(d, f, ("embed", "mlp"))
        # scaled as mamba's out_proj
        self.down_proj = linear(f, d, ("mlp", "embed"), scale=1 / math.sqrt(cfg.n_layer))

    def init_cache(self, batch: int, capacity: int = DEFAULT_CAPACITY) -> MlpCache:
        """The (empty) cache; `capacity` is unused."""
        return MlpCache()

    def _mlp(self, x: jax.Array) -> jax.Array:
        """x (..., d) -> (..., d)."""
        x = x.astype(self.dtype)
        gate = jax.nn.silu(self.gate_proj(x).astype(jnp.float32))  # SiLU in fp32, like the norms
        return self.down_proj((gate * self.up_proj(x)).astype(self.dtype))

    def __call__(
        self, x: jax.Array, *, cache: MlpCache | None = None, seq_idx=None, mask=None, rng=None
    ):
        """Parallel mode: x (b, l, d) -> (y (b, l, d), empty cache); seq_idx, mask, rng unused."""
        return self._mlp(x), MlpCache()

    def step(self, x: jax.Array, cache: MlpCache):
        """Recurrent mode, one token: x (b, d) -> (y (b, d), empty cache)."""
        return self._mlp(x), MlpCache()
