"""Parameter inits (mamba_ssm's) and the linear layer the mixers build with them."""

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hax_jax.layers.linear import Linear
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
) -> Linear:
    """Linear (an nnx.Linear) with the kernel (in, out) and bias (out,) on the logical `axes` and
    PyTorch's init scaled by `scale` (unless kwargs give a kernel_init); dtype: of the
    computation."""
    kwargs.setdefault("kernel_init", torch_linear_init(in_features, scale))
    return Linear(
        in_features,
        out_features,
        use_bias=use_bias,
        dtype=dtype,
        rngs=rngs,
        **linear_axes(*axes),
        **kwargs,
    )


HAX_CODE_STD = 0.1  # initializer_range of the HAX code's Mamba and Mamba-2 configs (configs/*.json)


def hax_code_init(model: nnx.Module, mixer_kinds: tuple[str, ...], key: jax.Array) -> None:
    """Re-draws `model`'s parameters as the HAX code's joint-recall models start (its models are
    flash-linear-attention's, whose _init_weights runs with initializer_range 0.1):
    - the embedding (the head too, when separate) and every linear kernel: normal, std 0.1; their
      biases 0 (the sparse branch's layers included);
    - mamba2 layers: the conv's kernel normal (std 0.1) and bias 0; A = 1..n_heads, one per head;
      out_proj kept (its config's rescale_prenorm_residual re-draws it there as mamba_ssm does);
    - mamba layers: the conv and dt_proj kept (PyTorch's default and the dt init there too), and
      out_proj normal (its config does not rescale);
    - dt_bias, D, the norms and the branch's gate E kept (drawn there as here)."""
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    keys = jax.random.split(key, max(len(leaves), 1))
    new = [
        _hax_code_value(_names(path), value, k, mixer_kinds)
        for (path, value), k in zip(leaves, keys)
    ]
    nnx.update(model, jax.tree_util.tree_unflatten(treedef, new))


def _names(path) -> tuple[str, ...]:
    """A tree path as its keys' names, without the Variable's own `value` attribute."""
    names = (str(getattr(p, "key", getattr(p, "idx", getattr(p, "name", p)))) for p in path)
    return tuple(n for n in names if n not in ("value", ".value"))


def _hax_code_value(names, value, key, mixer_kinds):
    """One parameter's HAX-code initial value (see hax_code_init), or `value` where it is kept."""
    normal = lambda: HAX_CODE_STD * jax.random.normal(key, value.shape, value.dtype)  # noqa: E731
    if names[0] in ("embedding", "lm_head"):
        return normal()
    if names[0] != "layers" or names[2] != "mixer":
        return value  # the blocks' norms and the final norm
    kind, (module, *rest) = mixer_kinds[int(names[1])], names[3:]
    if kind == "mamba2" and module == "A_log":
        # numpy's log: the same bits on every backend and inside or outside jit
        return jnp.asarray(np.log(np.arange(1, value.shape[0] + 1, dtype=np.float32)), value.dtype)
    kept = {"mamba2": ("out_proj",), "mamba": ("conv1d", "dt_proj")}[kind]
    if module in kept:
        return value
    if "kernel" in rest:
        return normal()
    if "bias" in rest:
        return jnp.zeros_like(value)
    return value
