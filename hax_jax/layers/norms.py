"""RMSNorm and the gated, grouped RMSNorm of Mamba-2."""

import jax
import jax.numpy as jnp
from flax import nnx

from hax_jax.parallel import per_device
from hax_jax.sharding import current_mesh
from pallas_kernels.backend import kernels_by_default
from pallas_kernels.gated_norm import gated_rms_norm


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

    def __init__(self, dim: int, *, group_size: int, eps: float = 1e-5, impl: str = "auto"):
        if dim % group_size:
            raise ValueError(
                f"GatedRMSNorm: dim={dim} must be a multiple of group_size={group_size}"
            )
        # Split over "tensor" with the heads; a group wider than one shard's channels makes its
        # mean square an all-reduce (free when the groups align with the shards, as in §8.1).
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32), logical_axes=("inner",))
        self.group_size = group_size
        self.eps = eps
        self.impl = impl

    def __call__(
        self, y: jax.Array, z: jax.Array | None = None, *, impl=None, added=None
    ) -> jax.Array:
        """y (..., dim), z (..., >= dim: the gate is its first dim channels, read in place by
        the kernels where a mesh does not split them) -> (..., dim); each group of `group_size`
        channels is normalised alone (pallas_kernels.gated_norm; `impl` overrides the layer's).
        added: (o (..., dim),
        gain (dim,)), the norm then of y + o * gain. Under a mesh, the kernels run per device on
        its rows and its groups; a group split over "tensor" is left to XLA (its mean square is
        then an all-reduce)."""
        impl = self.impl if impl is None else impl
        if impl == "auto":
            impl = "pallas" if kernels_by_default() else "reference"

        def norm(y, z, weight, o=None, gain=None, impl=impl):
            return gated_rms_norm(
                y,
                z,
                weight,
                group_size=self.group_size,
                eps=self.eps,
                added=None if o is None else (o, gain),
                impl=impl,
            )

        weight = self.weight[...]
        o, gain = (None, None) if added is None else added
        if impl == "reference" or y.ndim != 3:
            return norm(y, z, weight, o, gain)
        mesh = current_mesh()
        tensor = 1 if mesh is None else dict(mesh.shape).get("tensor", 1)
        if (weight.shape[0] // self.group_size) % tensor:
            return norm(y, z, weight, o, gain, impl="reference")
        rows = ("batch", "seq", "inner")
        z_rows = rows
        if z is not None and z.shape[-1] > y.shape[-1]:
            if tensor > 1:  # a device's gate would not be the first channels of its piece
                z = z[..., : y.shape[-1]]
            else:
                z_rows = ("batch", "seq", None)
        return per_device(
            norm,
            dict(y=y, z=z, weight=weight, o=o, gain=gain),
            dict(y=rows, z=z_rows, weight=("inner",), o=rows, gain=("inner",)),
            [rows],
            seq_aware=True,  # each token alone
        )
