"""One Mamba-2 decode step's SSM update as a Pallas Triton kernel on a bounded grid:

    h' = exp(dt A) h + dt x B^T,   y = h' C + D x        (each batch row and head)

the step of reference.ssd_sequential. XLA fuses this update into one kernel whose blocks fill
every SM. At batch 64 (HAX-Mamba-2 130M: 100 MB of fp32 state read and written a layer) a kernel
launched after it waits for it to drain, so a HAX layer's sparse branch, which needs none of its
output until the gated norm, runs after it instead of beside it (BENCHMARKS.md, "Thirty-fourth
session"). Here `programs` programs walk the (row, head) pairs in turn, leaving the rest of the
GPU to kernels beside it; the state is updated in place.

Letters: b batch, h heads, p head dim, n state dim, g groups.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ..backend import compiler_params, interpret_for

F32 = jnp.float32


def unsupported(p, n):
    """Why the kernel cannot take head dim p and state dim n, or None if it can."""
    for name, size in (("head dim p", p), ("state dim n", n)):
        if size & (size - 1):
            return f"the {name} = {size} is not a power of two (a Triton block dimension)"
    return None


def _update_kernel(
    x_ref, dt_ref, A_ref, B_ref, C_ref, D_ref, h_in, y_ref, h_ref, *, heads, per_group, programs
):
    """Pairs first, first + programs, ... of the b * h (row, head) pairs; h_in aliases h_ref.
    Each pair's state is loaded one pair ahead, so its latency passes while the pair before is
    updated and stored."""
    del h_in
    first = pl.program_id(0)
    pairs = y_ref.shape[0] * heads

    def row_head(i):
        pair = jnp.minimum(first + i * programs, pairs - 1)  # past the last: read, never written
        return pair // heads, pair % heads

    def load_state(i):
        row, head = row_head(i)
        return h_ref[row, head, :, :]

    def update(i, h_pn):
        row, head = row_head(i)
        next_h_pn = load_state(i + 1)
        group = head // per_group
        x_p = x_ref[row, head, :].astype(F32)
        dt = dt_ref[row, head]
        B_n, C_n = B_ref[row, group, :].astype(F32), C_ref[row, group, :].astype(F32)
        h_pn = jnp.exp(dt * A_ref[head]) * h_pn + (dt * x_p)[:, None] * B_n[None, :]
        h_ref[row, head, :, :] = h_pn
        y_ref[row, head, :] = jnp.sum(h_pn * C_n[None, :], axis=1) + D_ref[head] * x_p
        return next_h_pn

    count = (pairs - first + programs - 1) // programs
    jax.lax.fori_loop(0, count, update, load_state(0))


def ssm_step_pallas(h, x, dt, A, B, C, D, *, programs, interpret=None):
    """h (b, h, p, n) fp32, x (b, h, p), dt (b, h) fp32 (after softplus and clipping), A (h,)
    negative, B and C (b, g, n), D (h,) -> (y (b, h, p) fp32, h' (b, h, p, n) fp32) on
    min(programs, b * h) programs, h' written over h's buffer (XLA copies h first where it is
    read later)."""
    b, heads, p, n = h.shape
    groups = B.shape[1]
    grid = min(programs, b * heads)
    whole = lambda a: pl.BlockSpec(a.shape, lambda i: (0,) * a.ndim)  # noqa: E731
    args = (x, dt.astype(F32), A.astype(F32), B, C, D.astype(F32), h.astype(F32))
    kernel = functools.partial(
        _update_kernel, heads=heads, per_group=heads // groups, programs=grid
    )
    return pl.pallas_call(
        kernel,
        grid=(grid,),
        in_specs=[whole(a) for a in args],
        out_specs=[pl.BlockSpec((b, heads, p), lambda i: (0, 0, 0)), whole(h)],
        out_shape=[jax.ShapeDtypeStruct((b, heads, p), F32), jax.ShapeDtypeStruct(h.shape, F32)],
        input_output_aliases={6: 1},
        interpret=interpret_for("gpu", interpret),
        # Two (p, n) fp32 states live a program (this pair's and the next): 8 warps keep them in
        # registers at p 64, n 128 (64 values a thread).
        compiler_params=compiler_params("gpu", num_warps=8, num_stages=1),
    )(*args)
