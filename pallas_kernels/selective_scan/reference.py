"""Mamba-1 selective scan (S6), the definition: a sequential scan over time.

Follows Gu & Dao, "Mamba: Linear-Time Sequence Modeling with Selective State Spaces"
(arXiv:2312.00752), Algorithm 2, discretized exactly like the official `selective_scan_ref`:
zero-order hold for A (exp(dt * A)) and the simplified Euler rule for B (dt * B).
"""

import jax
import jax.numpy as jnp


def compute_dtype(*arrays):
    """Dtype the scan runs in: at least fp32 (bf16 in -> fp32, fp64 stays fp64)."""
    return jnp.promote_types(jnp.result_type(*[a for a in arrays if a is not None]), jnp.float32)


def selective_scan_reference(
    x, dt, A, B, C, *, D=None, z=None, initial_state=None, return_final_state=False
):
    """Run the S6 recurrence one step at a time (the definition the fast paths must match).

    Shapes: x, dt, z (b, l, d); A (d, n); B, C (b, l, n); D (d,); initial_state (b, d, n).
    dt must already be positive (softplus applied by the caller); A is usually negative.

        h_t = exp(dt_t * A) * h_{t-1} + (dt_t * B_t) * x_t        (elementwise over (d, n))
        y_t = sum_n C_t[n] h_t[:, n] + D * x_t,   then y *= silu(z) when z is given.

    Returns y (b, l, d) in x.dtype, or (y, final_state) with final_state (b, d, n) in the
    compute dtype (fp32 for fp32/bf16 inputs) when return_final_state is True.
    """
    dtype = compute_dtype(x, dt, A, B, C, D, z, initial_state)
    b, _, d = x.shape
    n = A.shape[1]
    x_bld, dt_bld = x.astype(dtype), dt.astype(dtype)
    A_dn, B_bln, C_bln = A.astype(dtype), B.astype(dtype), C.astype(dtype)
    if initial_state is None:
        h0_bdn = jnp.zeros((b, d, n), dtype)
    else:
        h0_bdn = initial_state.astype(dtype)

    def step(h_bdn, inputs):
        """Advance the state by one time step and read out y_t."""
        x_bd, dt_bd, B_bn, C_bn = inputs
        decay_bdn = jnp.exp(dt_bd[:, :, None] * A_dn)
        h_bdn = decay_bdn * h_bdn + (dt_bd * x_bd)[:, :, None] * B_bn[:, None, :]
        y_bd = jnp.einsum("bdn,bn->bd", h_bdn, C_bn)
        return h_bdn, y_bd

    # lax.scan runs over the leading axis, so feed the sequence time-major.
    xs = tuple(jnp.moveaxis(v, 1, 0) for v in (x_bld, dt_bld, B_bln, C_bln))
    hT_bdn, y_lbd = jax.lax.scan(step, h0_bdn, xs)
    y_bld = jnp.moveaxis(y_lbd, 0, 1)
    if D is not None:
        y_bld = y_bld + D.astype(dtype) * x_bld
    if z is not None:
        y_bld = y_bld * jax.nn.silu(z.astype(dtype))
    y_bld = y_bld.astype(x.dtype)
    return (y_bld, hT_bdn) if return_final_state else y_bld
