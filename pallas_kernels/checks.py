"""Input checks shared by the public ops: errors name the argument and the value."""

import jax.numpy as jnp


def check_shape(name, arr, shape, desc):
    """Raise ValueError naming `arr` if its shape is not `shape` (described by `desc`)."""
    if tuple(arr.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {desc} = {tuple(shape)}, got {arr.shape}")


def check_float(name, arr):
    """Raise ValueError naming `arr` unless it has a floating dtype."""
    if not jnp.issubdtype(arr.dtype, jnp.floating):
        raise ValueError(f"{name} must have a floating dtype (fp32 or bf16), got {arr.dtype}")
