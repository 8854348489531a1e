"""The definition: Mamba-2's gated, grouped RMSNorm (norm_before_gate=False), in fp32.

out = w * n, n = u / sqrt(mean_group(u^2) + eps), u = y * silu(z) (u = y without a gate); each
group of `group_size` channels is normalised alone. With `added` = (o, gain), y + o * gain takes y's
place (HAX: the sparse branch's output, gated per channel, added to the SSD's).
"""

import jax
import jax.numpy as jnp


def gated_rms_norm_reference(y, z, weight, *, group_size: int, eps: float, added=None):
    """y (..., e), z (..., >= e: its first e channels), weight (e,), added None or (o (..., e),
    gain (e,)) -> (..., e) in y's dtype."""
    u = y.astype(jnp.float32)
    z = None if z is None else z[..., : y.shape[-1]]
    if added is not None:
        u = u + added[0].astype(jnp.float32) * added[1].astype(jnp.float32)
    if z is not None:
        u = u * jax.nn.silu(z.astype(jnp.float32))
    groups = u.reshape(*u.shape[:-1], -1, group_size)
    groups = groups * jax.lax.rsqrt(jnp.mean(groups * groups, axis=-1, keepdims=True) + eps)
    return (weight * groups.reshape(u.shape)).astype(y.dtype)
