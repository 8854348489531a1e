"""RMSNorm and the gated, grouped RMSNorm of Mamba-2."""

import jax
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis, computed in fp32, returned in the input dtype."""

    def __init__(self, dim: int, *, eps: float = 1e-5, axis: str = "embed"):
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32), logical_axes=(axis,))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        """x (..., dim) -> (..., dim)."""
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (self.weight[...] * x32).astype(x.dtype)


class GatedRMSNorm(nnx.Module):
    """Mamba-2's norm after the gate: RMSNorm_grouped(y * silu(z)) * w (norm_before_gate=False)."""

    def __init__(self, dim: int, *, group_size: int, eps: float = 1e-5):
        if dim % group_size:
            raise ValueError(
                f"GatedRMSNorm: dim={dim} must be a multiple of group_size={group_size}"
            )
        # Split over "tensor" with the heads; a group wider than one shard's channels makes its
        # mean square an all-reduce (free when the groups align with the shards, as in §8.1).
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32), logical_axes=("inner",))
        self.group_size = group_size
        self.eps = eps

    def __call__(self, y: jax.Array, z: jax.Array | None = None) -> jax.Array:
        """y, z (..., dim) -> (..., dim); each group of `group_size` channels is normalised
        alone."""
        y32 = y.astype(jnp.float32)
        if z is not None:
            y32 = y32 * jax.nn.silu(z.astype(jnp.float32))
        groups = y32.reshape(*y32.shape[:-1], -1, self.group_size)
        groups = groups * jax.lax.rsqrt(
            jnp.mean(groups * groups, axis=-1, keepdims=True) + self.eps
        )
        return (self.weight[...] * groups.reshape(y32.shape)).astype(y.dtype)
