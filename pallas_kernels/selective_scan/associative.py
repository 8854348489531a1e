"""Chunked associative-scan fast path for the Mamba-1 selective scan, pure JAX on any backend.

The S6 recurrence h_t = a_t * h_{t-1} + u_t is a first-order linear recurrence, so pairs
(a, u) compose associatively (Blelloch, "Prefix sums and their applications", 1990; used for
S5 by Smith et al., arXiv:2208.04933). A full-length associative scan would keep
(b, l, d, n) alive; instead we scan within chunks of `chunk_size` steps, carry h across
chunks with lax.scan, contract with C inside the chunk, and checkpoint the chunk body, so
only (b, chunk, d, n) is live in forward and backward (the trade Mamba's fused kernel makes
by recomputing states in the backward, arXiv:2312.00752 §3.3.2).
"""

import functools

import jax
import jax.numpy as jnp

from .reference import compute_dtype


def _combine(earlier, later):
    """Compose two affine maps h -> a*h + u, `earlier` applied first."""
    a_e, u_e = earlier
    a_l, u_l = later
    return a_l * a_e, a_l * u_e + u_l


def _to_chunks(v_bl, c, s):
    """Zero-pad axis 1 to c*s and reshape to chunk-major (c, b, s, ...)."""
    pad = c * s - v_bl.shape[1]
    v_bl = jnp.pad(v_bl, [(0, 0), (0, pad)] + [(0, 0)] * (v_bl.ndim - 2))
    v_bcs = v_bl.reshape(v_bl.shape[0], c, s, *v_bl.shape[2:])
    return jnp.moveaxis(v_bcs, 1, 0)


@functools.partial(jax.jit, static_argnames=("return_final_state", "chunk_size"))
def selective_scan_associative(
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
    chunk_size=64,
):
    """Selective scan via per-chunk associative scans; same contract as the reference.

    Shapes: x, dt, z (b, l, d); A (d, n); B, C (b, l, n); D (d,); initial_state (b, d, n).
    Any l works: the tail is padded with dt = 0 (decay exp(0) = 1, zero input), which leaves
    the state unchanged, and padded outputs are dropped.
    """
    dtype = compute_dtype(x, dt, A, B, C, D, z, initial_state)
    b, l, d = x.shape
    n = A.shape[1]
    # A short sequence runs as one chunk of its own length instead of padding a full chunk.
    s = max(1, min(chunk_size, l))
    c = -(-l // s)
    x_bld, dt_bld = x.astype(dtype), dt.astype(dtype)
    A_dn = A.astype(dtype)
    xs = tuple(_to_chunks(v, c, s) for v in (x_bld, dt_bld, B.astype(dtype), C.astype(dtype)))
    if initial_state is None:
        h0_bdn = jnp.zeros((b, d, n), dtype)
    else:
        h0_bdn = initial_state.astype(dtype)

    @jax.checkpoint
    def chunk(h_bdn, inputs):
        """Scan one chunk from carried state h_bdn; return its last state and its outputs."""
        x_bsd, dt_bsd, B_bsn, C_bsn = inputs
        decay_bsdn = jnp.exp(dt_bsd[..., None] * A_dn)
        u_bsdn = (dt_bsd * x_bsd)[..., None] * B_bsn[:, :, None, :]
        # Prefix compositions within the chunk: h_s = decay_cum_s * h_in + h_local_s.
        decay_cum_bsdn, h_local_bsdn = jax.lax.associative_scan(
            _combine, (decay_bsdn, u_bsdn), axis=1
        )
        h_bsdn = h_local_bsdn + decay_cum_bsdn * h_bdn[:, None]
        y_bsd = jnp.einsum("bsdn,bsn->bsd", h_bsdn, C_bsn)
        return h_bsdn[:, -1], y_bsd

    hT_bdn, y_cbsd = jax.lax.scan(chunk, h0_bdn, xs)
    y_bld = jnp.moveaxis(y_cbsd, 0, 1).reshape(b, c * s, d)[:, :l]
    if D is not None:
        y_bld = y_bld + D.astype(dtype) * x_bld
    if z is not None:
        y_bld = y_bld * jax.nn.silu(z.astype(dtype))
    y_bld = y_bld.astype(x.dtype)
    return (y_bld, hT_bdn) if return_final_state else y_bld
