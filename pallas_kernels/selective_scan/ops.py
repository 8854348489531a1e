"""Public Mamba-1 selective scan: input checks plus the `impl=` switch."""

import functools

import jax
import jax.numpy as jnp

from .. import backend
from ..checks import check_float, check_shape
from . import pallas, tiling
from .associative import selective_scan_associative
from .reference import selective_scan_reference

IMPLS = ("auto", "associative", "pallas", "reference")


def _validate(x, dt, A, B, C, D, z, initial_state, impl, chunk_size, z_start=0):
    """Check shapes, dtypes and static arguments; return (b, l, d, n)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if x.ndim != 3:
        raise ValueError(f"x must have shape (b, l, d), got {x.shape}")
    b, l, d = x.shape
    if A.ndim != 2 or A.shape[0] != d:
        raise ValueError(f"A must have shape (d, n) with d = {d}, got {A.shape}")
    n = A.shape[1]
    check_shape("dt", dt, (b, l, d), "(b, l, d)")
    check_shape("B", B, (b, l, n), "(b, l, n)")
    check_shape("C", C, (b, l, n), "(b, l, n)")
    for name, arr in (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C)):
        check_float(name, arr)
    if isinstance(z_start, bool) or not isinstance(z_start, int) or z_start < 0:
        raise ValueError(f"z_start must be a non-negative int, got {z_start!r}")
    if z is not None and (z.ndim != 3 or z.shape[:2] != (b, l) or z.shape[2] < z_start + d):
        raise ValueError(
            f"z must have shape (b, l, >= z_start + d) = ({b}, {l}, >= {z_start + d}), "
            f"got {z.shape}"
        )
    optional = (
        ("D", D, (d,), "(d,)"),
        ("initial_state", initial_state, (b, d, n), "(b, d, n)"),
    )
    for name, arr, shape, desc in optional:
        if arr is not None:
            check_shape(name, arr, shape, desc)
            check_float(name, arr)
    if z is not None:
        check_float("z", z)
    return b, l, d, n


def _check_pallas(arrays, variant, block_sizes):
    """What impl="pallas" needs beyond the op's contract (fp32/bf16 inputs, a known variant,
    valid block sizes; ValueError naming the value otherwise); returns the resolved sizes."""
    backend.check_variant(variant)
    for name, arr in arrays.items():
        if arr is not None and arr.dtype == jnp.float64:
            raise ValueError(f"impl='pallas' computes in fp32; {name} is float64")
    if block_sizes is not None and not isinstance(block_sizes, tiling.BlockSizes):
        raise ValueError(f"block_sizes must be a BlockSizes, got {block_sizes!r}")
    return tiling.resolve_block_sizes(variant, block_sizes)


def _fwd_knobs(sizes):
    """Forward kernel keyword arguments of a resolved BlockSizes."""
    return dict(
        chunk=sizes.chunk,
        chunk_bwd=sizes.chunk_bwd,
        block_d=sizes.block_d,
        num_warps=sizes.num_warps,
    )


def _bwd_knobs(sizes):
    """Backward kernel keyword arguments of a resolved BlockSizes."""
    return dict(chunk_bwd=sizes.chunk_bwd, block_d=sizes.block_d_bwd, num_warps=sizes.num_warps_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11, 12))
def _pallas_scan(x, dt, A, B, C, D, z, initial_state, variant, interpret, sizes, recompute, z_at):
    """(y, final state) by the Pallas kernels, differentiable through the fused backward; the
    gate is z's channels from z_at (z may be wider than x)."""
    y, final, _ = _forward(x, dt, A, B, C, D, z, initial_state, variant, interpret, sizes, z_at)
    return y, final


def _forward(
    x, dt, A, B, C, D, z, initial_state, variant, interpret, sizes, z_at, save_states=False
):
    """pallas.forward with the resolved sizes: (y, final state, the saved states or None)."""
    return pallas.forward(
        x,
        dt,
        A,
        B,
        C,
        D,
        z,
        initial_state,
        variant=variant,
        z_start=z_at,
        interpret=interpret,
        save_states=save_states,
        **_fwd_knobs(sizes),
    )


def _pallas_scan_fwd(
    x, dt, A, B, C, D, z, initial_state, variant, interpret, sizes, recompute, z_at
):
    """Forward that also saves the state every chunk_bwd steps for the backward, unless the
    backward is to recompute them."""
    inputs = (x, dt, A, B, C, D, z, initial_state)
    statics = (variant, interpret, sizes, z_at)
    y, final, states = _forward(*inputs, *statics, save_states=not recompute)
    return (y, final), (*inputs, states)


def _pallas_scan_bwd(variant, interpret, sizes, recompute, z_at, residuals, cotangents):
    """Cotangents of every input (None for absent optional ones), in the inputs' dtypes; a
    wider z's other channels take zeros."""
    x, dt, A, B, C, D, z, initial_state, states = residuals
    if recompute:  # the forward again, this time keeping its states
        statics = (variant, interpret, sizes, z_at)
        _, _, states = _forward(*residuals[:-1], *statics, save_states=True)
    dout, dfinal = cotangents
    dx, ddt, dA, dB, dC, dD, dz, dh0 = pallas.backward(
        x,
        dt,
        A,
        B,
        C,
        D,
        z,
        initial_state,
        states,
        dout,
        dfinal,
        variant=variant,
        z_start=z_at,
        interpret=interpret,
        **_bwd_knobs(sizes),
    )
    if dz is not None and dz.shape != z.shape:
        d = x.shape[2]
        dz = jnp.pad(dz, [(0, 0), (0, 0), (z_at, z.shape[2] - z_at - d)])
    cast = lambda grad, primal: None if primal is None else grad.astype(primal.dtype)  # noqa: E731
    return (
        dx,
        ddt,
        cast(dA, A),
        cast(dB, B),
        cast(dC, C),
        cast(dD, D),
        dz,
        cast(dh0, initial_state),
    )


_pallas_scan.defvjp(_pallas_scan_fwd, _pallas_scan_bwd)


def saved_states_bytes(b, l, d, n, *, variant=None, block_sizes=None) -> int:
    """Bytes of the fp32 states impl="pallas" keeps from the forward for the backward, one every
    chunk_bwd steps, (b, l / chunk_bwd, d, n) as the kernels pad l and n: what
    recompute_states=True does not keep."""
    variant = variant or backend.default_variant()
    sizes = tiling.resolve_block_sizes(variant, block_sizes)
    geo = tiling.geometry(variant, l, d, n, sizes.chunk, sizes.chunk_bwd, sizes.block_d)
    return b * geo.num_saved * d * geo.n_pad * 4


@functools.partial(
    jax.jit,
    static_argnames=(
        "return_final_state",
        "impl",
        "chunk_size",
        "variant",
        "interpret",
        "block_sizes",
        "recompute_states",
        "z_start",
    ),
)
def selective_scan(
    x,
    dt,
    A,
    B,
    C,
    *,
    D=None,
    z=None,
    initial_state=None,
    return_final_state=False,
    impl="auto",
    chunk_size=64,
    variant=None,
    interpret=None,
    block_sizes=None,
    recompute_states=False,
    z_start=0,
):
    """Mamba-1 selective scan (S6): y, or (y, final_state) if return_final_state.

    Shapes: x, dt, z (b, l, d); A (d, n); B, C (b, l, n); D (d,); initial_state (b, d, n).
    z may be wider, (b, l, >= z_start + d) (in_proj's whole output [x | z]): the gate is its
    channels z_start .. z_start + d, which the Pallas kernels read in place where they can
    (a slice would be copied for them, and kept for the backward beside that output) and its
    other channels take a zero gradient.
    dt is already positive (softplus applied by the caller). Computes in fp32 (fp64 inputs
    stay fp64); y comes back in x.dtype, final_state (b, d, n) in the compute dtype.
    impl: "auto" ("pallas" where `backend.auto_picks_pallas()` and the inputs are fp32/bf16,
    else "associative"), "associative" (chunked associative scan, `chunk_size` steps per
    chunk), "pallas"
    (fused Pallas kernels with a fused backward; fp32/bf16 inputs; ignores chunk_size) or
    "reference" (sequential lax.scan over time; ignores chunk_size).
    Pallas only: variant "gpu" (Triton) or "tpu" (Mosaic), None = the backend's; interpret
    None = compiled on the variant's hardware, interpreted elsewhere, True = interpreted;
    block_sizes a BlockSizes of tuning knobs (None = the variant's defaults);
    recompute_states: the backward reruns the forward kernel for the fp32 states it needs, every
    chunk_bwd steps, instead of keeping them from the forward ((b, l / chunk_bwd, d, n) held from
    the forward to the backward: for a model, every layer's at once) - one more forward kernel
    for that memory. The other impls ignore it (they keep what autodiff saves).
    """
    _validate(x, dt, A, B, C, D, z, initial_state, impl, chunk_size, z_start)
    if not isinstance(recompute_states, bool):
        raise ValueError(f"recompute_states must be a bool, got {recompute_states!r}")
    arrays = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, initial_state=initial_state)
    if impl == "auto":
        fp64 = any(a is not None and a.dtype == jnp.float64 for a in arrays.values())
        usable = backend.auto_picks_pallas() and variant in (None, "gpu") and not fp64
        impl = "pallas" if usable else "associative"
    if impl == "pallas":
        variant = variant or backend.default_variant()
        sizes = _check_pallas(arrays, variant, block_sizes)
        statics = (variant, interpret, sizes, recompute_states, z_start)
        y, final = _pallas_scan(x, dt, A, B, C, D, z, initial_state, *statics)
        return (y, final) if return_final_state else y
    gate = z if z is None else z[..., z_start : z_start + x.shape[2]]
    kwargs = dict(D=D, z=gate, initial_state=initial_state, return_final_state=return_final_state)
    if impl == "reference":
        return selective_scan_reference(x, dt, A, B, C, **kwargs)
    return selective_scan_associative(x, dt, A, B, C, chunk_size=chunk_size, **kwargs)
