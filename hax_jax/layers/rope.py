"""Rotary position embeddings (RoPE), rotate-half convention (GPT-NeoX / LLaMA layout)."""

import jax
import jax.numpy as jnp


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotates x (..., l, h, d) by its positions (..., l) (or (l,)); the result has x's dtype.

    Channel i < d/2 pairs with channel i + d/2 and turns by the angle pos * theta^(-2i/d).
    """
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"RoPE needs an even head dim, got {d}")
    inv_freq = theta ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)  # (d/2,)
    # fp32 angles whatever the compute dtype: bf16 positions would round away rotation detail.
    angles = jnp.asarray(positions, jnp.float32)[..., None] * inv_freq  # (..., l, d/2)
    cos, sin = jnp.cos(angles)[..., None, :], jnp.sin(angles)[..., None, :]  # broadcast over heads
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
