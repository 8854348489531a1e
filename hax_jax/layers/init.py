"""Parameter inits (mamba_ssm's) and the linear layer the mixers build with them."""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from hax_jax.sharding import linear_axes


def torch_linear_init(fan_in: int, scale: float = 1.0):
    """PyTorch's default Linear/Conv init, U(+-1/sqrt(fan_in)), optionally scaled (mamba_ssm keeps
    it)."""
    bound = scale / math.sqrt(fan_in)

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


def dt_bias_init(dt_min: float, dt_max: float, floor: float):
    """Inverse softplus of a log-uniform dt in [dt_min, dt_max], clamped at `floor` (official
    init)."""

    def init(key, shape, dtype=jnp.float32):
        u = jax.random.uniform(key, shape, jnp.float32)
        dt = jnp.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = jnp.maximum(dt, floor)
        return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)

    return init


def linear(
    in_features: int,
    out_features: int,
    axes: tuple[str | None, str | None],
    *,
    rngs: nnx.Rngs,
    dtype=None,
    use_bias: bool = False,
    scale: float = 1.0,
    **kwargs,
) -> nnx.Linear:
    """nnx.Linear with the kernel (in, out) and bias (out,) on the logical `axes` and PyTorch's
    init scaled by `scale` (unless kwargs give a kernel_init); dtype: of the computation."""
    kwargs.setdefault("kernel_init", torch_linear_init(in_features, scale))
    return nnx.Linear(
        in_features,
        out_features,
        use_bias=use_bias,
        dtype=dtype,
        rngs=rngs,
        **linear_axes(*axes),
        **kwargs,
    )
