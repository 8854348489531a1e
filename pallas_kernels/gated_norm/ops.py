"""Public gated RMSNorm: input checks, the `impl=` switch and the kernels' custom VJP."""

import functools

import jax
import jax.numpy as jnp

from .. import backend
from . import kernel
from .reference import gated_rms_norm_reference

IMPLS = ("auto", "reference", "pallas")


def gated_rms_norm(
    y, z, weight, *, group_size: int, eps: float, added=None, impl="auto", interpret=None
):
    """Mamba-2's gated, grouped RMSNorm: y (..., e), z (..., >= e) (z None: no gate), weight
    (e,) -> (..., e) in y's dtype (reference.py defines it). A z wider than y gates with its
    first e channels (a projection's whole output, [z | x | ...]): the kernels read them in place
    where the groups allow (one group, or a power-of-two group size), where a slice would be a
    copy (and, saved for the backward beside the projection's output, a second one). added:
    (o (..., e), gain (e,)), the norm then of y + o * gain (o's product and sum taken in the
    kernels, gain's gradient summed there). impl
    "auto" takes the Triton kernels on a GPU outside automatically partitioned meshes, else the
    reference; "pallas" forces them (interpreted on a CPU)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    e = y.shape[-1]
    if weight.shape != (e,):
        raise ValueError(f"weight must have shape ({e},) for y {y.shape}, got {weight.shape}")
    if z is not None and (z.shape[:-1] != y.shape[:-1] or z.shape[-1] < e):
        raise ValueError(f"z must have y's shape {y.shape} or more channels, got {z.shape}")
    if added is not None and (added[0].shape != y.shape or added[1].shape != (e,)):
        raise ValueError(
            f"added must be (o {y.shape}, gain ({e},)), got {added[0].shape}, {added[1].shape}"
        )
    if group_size <= 0 or e % group_size:
        raise ValueError(f"group_size must divide the last axis, {e}; got {group_size}")
    if impl == "auto":
        impl = "pallas" if backend.auto_picks_pallas() else "reference"
    if impl == "reference":
        return gated_rms_norm_reference(y, z, weight, group_size=group_size, eps=eps, added=added)
    if jax.default_backend() == "tpu":
        raise ValueError("impl='pallas' has Triton (GPU) kernels only; on a TPU use 'reference'")
    shape = (-1, e // group_size, group_size)
    if z is not None and z.shape[-1] > e and not kernel.reads_in_place(e, group_size):
        z = z[..., :e]
    # z's rows as (rows, channels) where it is wider: the kernels read its first e channels.
    z3 = None if z is None else z.reshape(shape if z.shape[-1] == e else (-1, z.shape[-1]))
    if added is not None:
        added = (added[0].reshape(shape), added[1].reshape(shape[1:]))
    out = _norm(y.reshape(shape), z3, weight.reshape(shape[1:]), added, eps, interpret)
    return out.reshape(y.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _norm(y, z, weight, added, eps, interpret):
    return kernel.forward(y, z, weight, eps=eps, added=added, interpret=interpret)[0]


def _norm_fwd(y, z, weight, added, eps, interpret):
    out, rstd = kernel.forward(y, z, weight, eps=eps, added=added, interpret=interpret)
    return out, (y, z, weight, added, rstd)


def _norm_bwd(eps, interpret, residuals, dout):
    y, z, weight, added, rstd = residuals
    dy, dz, dw_parts, d_added = kernel.backward(
        y, z, weight, rstd, dout, added=added, interpret=interpret
    )
    if z is not None and z.ndim == 2:  # a wider z: its other channels take no gradient
        dz = dz.reshape(z.shape[0], -1)
        dz = jnp.pad(dz, [(0, 0), (0, z.shape[1] - dz.shape[1])])
    if added is not None:
        d_added = (d_added[0], jnp.sum(d_added[1], axis=0).astype(added[1].dtype))
    return dy, dz, jnp.sum(dw_parts, axis=0).astype(weight.dtype), d_added


_norm.defvjp(_norm_fwd, _norm_bwd)
