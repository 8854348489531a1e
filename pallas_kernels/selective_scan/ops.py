"""Public Mamba-1 selective scan: input checks plus the `impl=` switch."""

import functools

import jax

from ..checks import check_float, check_shape
from .associative import selective_scan_associative
from .reference import selective_scan_reference

IMPLS = ("associative", "reference")


def _validate(x, dt, A, B, C, D, z, initial_state, impl, chunk_size):
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
    optional = (
        ("D", D, (d,), "(d,)"),
        ("z", z, (b, l, d), "(b, l, d)"),
        ("initial_state", initial_state, (b, d, n), "(b, d, n)"),
    )
    for name, arr, shape, desc in optional:
        if arr is not None:
            check_shape(name, arr, shape, desc)
            check_float(name, arr)
    return b, l, d, n


@functools.partial(jax.jit, static_argnames=("return_final_state", "impl", "chunk_size"))
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
    impl="associative",
    chunk_size=64,
):
    """Mamba-1 selective scan (S6): y, or (y, final_state) if return_final_state.

    Shapes: x, dt, z (b, l, d); A (d, n); B, C (b, l, n); D (d,); initial_state (b, d, n).
    dt is already positive (softplus applied by the caller). Computes in fp32 (fp64 inputs
    stay fp64); y comes back in x.dtype, final_state (b, d, n) in the compute dtype.
    impl: "associative" (chunked associative scan, `chunk_size` steps per chunk) or
    "reference" (sequential lax.scan over time; ignores chunk_size).
    """
    _validate(x, dt, A, B, C, D, z, initial_state, impl, chunk_size)
    kwargs = dict(D=D, z=z, initial_state=initial_state, return_final_state=return_final_state)
    if impl == "reference":
        return selective_scan_reference(x, dt, A, B, C, **kwargs)
    return selective_scan_associative(x, dt, A, B, C, chunk_size=chunk_size, **kwargs)
