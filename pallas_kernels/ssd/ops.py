"""Public Mamba-2 SSD: input checks plus the `impl=` switch."""

import functools

import jax
import jax.numpy as jnp

from ..checks import check_float, check_shape
from .chunked import ssd_chunked
from .reference import ssd_reference, ssd_sequential

IMPLS = ("chunked", "reference", "sequential")


def _validate(x, dt, A, B, C, D, initial_state, seq_idx, chunk_size, impl):
    """Check shapes, dtypes and static arguments; return (b, l, h, p, g, n)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if x.ndim != 4:
        raise ValueError(f"x must have shape (b, l, h, p), got {x.shape}")
    b, l, h, p = x.shape
    check_shape("dt", dt, (b, l, h), "(b, l, h)")
    check_shape("A", A, (h,), "(h,)")
    if B.ndim != 4 or B.shape[:2] != (b, l):
        raise ValueError(f"B must have shape (b, l, g, n) with (b, l) = {(b, l)}, got {B.shape}")
    g, n = B.shape[2:]
    check_shape("C", C, (b, l, g, n), "(b, l, g, n)")
    if g == 0 or h % g != 0:
        raise ValueError(f"heads h = {h} must be a multiple of groups g = {g}")
    for name, arr in (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C)):
        check_float(name, arr)
    for name, arr, shape, desc in (
        ("D", D, (h,), "(h,)"),
        ("initial_state", initial_state, (b, h, p, n), "(b, h, p, n)"),
    ):
        if arr is not None:
            check_shape(name, arr, shape, desc)
            check_float(name, arr)
    if seq_idx is not None:
        check_shape("seq_idx", seq_idx, (b, l), "(b, l)")
        if not jnp.issubdtype(seq_idx.dtype, jnp.integer):
            raise ValueError(f"seq_idx must have an integer dtype, got {seq_idx.dtype}")
    return b, l, h, p, g, n


@functools.partial(jax.jit, static_argnames=("chunk_size", "return_final_state", "impl"))
def ssd(
    x,
    dt,
    A,
    B,
    C,
    *,
    chunk_size,
    D=None,
    initial_state=None,
    return_final_state=False,
    seq_idx=None,
    impl="chunked",
):
    """Mamba-2 SSD: y, or (y, final_state) if return_final_state.

    Shapes: x (b, l, h, p); dt (b, l, h) positive (softplus'd and clamped by the caller);
    A (h,) negative; B, C (b, l, g, n), head hh reads group hh // (h // g); D (h,) skip on the
    unscaled x; initial_state (b, h, p, n); seq_idx (b, l) int32, nondecreasing.

        h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,   y_t = h_t C_t + D x_t.

    seq_idx marks packed documents: y equals running ssd separately on each maximal run of
    equal seq_idx in a row, with initial_state applied only to the row's first run; the final
    state is the state at the end of the row's last run (started from zero at that run's
    start unless it is also the first run). No state crosses a change of seq_idx.
    Computes in fp32 (fp64 inputs stay fp64); y in x.dtype, final_state (b, h, p, n) in the
    compute dtype. impl: "chunked" (Mamba-2 chunked algorithm, `chunk_size` a positive int),
    "reference" (quadratic form, O(l^2)) or "sequential" (step-by-step recurrence); the last
    two validate but ignore chunk_size.
    """
    _validate(x, dt, A, B, C, D, initial_state, seq_idx, chunk_size, impl)
    kwargs = dict(
        D=D, initial_state=initial_state, return_final_state=return_final_state, seq_idx=seq_idx
    )
    if impl == "reference":
        return ssd_reference(x, dt, A, B, C, **kwargs)
    if impl == "sequential":
        return ssd_sequential(x, dt, A, B, C, **kwargs)
    return ssd_chunked(x, dt, A, B, C, chunk_size=chunk_size, **kwargs)
