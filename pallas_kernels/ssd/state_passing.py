"""The SSD's state passing over chunks (kernel.py's "pass"): H_in[c+1] = decay_c H_in[c] + S_c
from an initial state, and its reverse for the state gradients. gpu: a Pallas (Triton) kernel with
the carry in registers; tpu: a lax.scan. Letters as in kernel.py."""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ..backend import compiler_params, interpret_for

F32 = jnp.float32


def _pass_kernel(s_ref, decay_ref, h0_ref, *refs, reverse):
    """One (b, h, block of p rows): out[c] = the carry entering chunk c, carry = decay[c] *
    carry + s[c], over the chunks in order (or in reverse); last = the carry after all of them.
    With an `other` input (reverse: the forward's H_in), also dots[c] = sum(out[c] * other[c])
    over the block."""
    other_ref, out_ref, last_ref, dots_ref = refs if len(refs) == 4 else (None, *refs, None)
    num = s_ref.shape[0]

    def body(j, carry_pn):
        ci = num - 1 - j if reverse else j
        out_ref[ci] = carry_pn.astype(out_ref.dtype)
        if other_ref is not None:
            dots_ref[ci] = jnp.sum(carry_pn * other_ref[ci].astype(F32))
        return decay_ref[ci] * carry_pn + s_ref[ci]

    last_ref[...] = jax.lax.fori_loop(0, num, body, h0_ref[...])


# Rows of p a state-passing program: each program walks all chunks in order, one (rows, n) tile
# a step, so its loads wait on each other; only many programs hide that latency. A 16K row of 24
# heads of 64 (H200, bench/ssd_kernel.py, BENCHMARKS.md): 2 rows (768 programs) against 16 (96)
# took the forward pass from 47.4 to 35.6 us and the reverse from 118.0 to 76.8.
MOST_STATE_ROWS = 16
MIN_STATE_PROGRAMS = 512


def _state_rows(prep, batch_heads, p):
    """Rows of p per state-passing program: BlockSizes.state_rows (at most p), else 16, halved
    down to 2 while the grid has fewer than MIN_STATE_PROGRAMS programs."""
    if prep.sizes.state_rows is not None:
        return min(p, prep.sizes.state_rows)
    rows = min(p, MOST_STATE_ROWS)
    while rows > 2 and batch_heads * (p // rows) < MIN_STATE_PROGRAMS:
        rows //= 2
    return rows


def _pass(prep, s_bchpn, h0_bhpn, *, reverse, other=None, interpret=None):
    """(carries (b, c, h, p', n') of the linear recurrence over chunks, last carry, and with
    `other` (b, c, h, p', n') the per-chunk sums of carries * other (b, h, c), else None).

    The carry runs in fp32; the carries are stored in the matmul dtype, which is all their
    readers use (they feed the kernels' matmuls; mamba_ssm keeps passed states in the inputs'
    dtype too): bf16 inputs halve this largest traffic of the state path. The last carry (the
    final state) stays fp32.

    gpu: a Pallas kernel, one program per (b, h, block of rows of p: `_state_rows`) with the
    carry in registers (splitting p: b h programs alone are too few to hide the loads'
    latency); tpu: a lax.scan."""
    if not prep.layout.gpu:

        def step(carry_bhpn, inputs):
            decay_bh, s_bhpn = inputs
            return decay_bh[..., None, None] * carry_bhpn + s_bhpn, carry_bhpn

        xs = (jnp.moveaxis(prep.decay, 2, 0), jnp.moveaxis(s_bchpn, 1, 0))
        last, out_cbhpn = jax.lax.scan(step, h0_bhpn, xs, reverse=reverse)
        out = jnp.moveaxis(out_cbhpn, 0, 1)
        dots = None
        if other is not None:
            dots = jnp.einsum("bchpn,bchpn->bhc", out, other.astype(F32))
        return out.astype(prep.mm_dtype), last, dots
    b, c, h, p, n = s_bchpn.shape
    bp = _state_rows(prep, b * h, p)
    grid = (b, h, p // bp)
    state = pl.BlockSpec((None, None, bp, n), lambda bi, hi, pi: (bi, hi, pi, 0))
    chunks = pl.BlockSpec((None, c, None, bp, n), lambda bi, hi, pi: (bi, 0, hi, pi, 0))
    per_chunk = pl.BlockSpec((None, None, c), lambda bi, hi, pi: (bi, hi, 0))
    in_specs = [chunks, per_chunk, state]
    out_specs = [chunks, state]
    out_shape = [
        jax.ShapeDtypeStruct(s_bchpn.shape, prep.mm_dtype),
        jax.ShapeDtypeStruct(h0_bhpn.shape, F32),
    ]
    args = [s_bchpn, prep.decay, h0_bhpn]
    if other is not None:
        in_specs.append(chunks)
        args.append(other)
        out_specs.append(pl.BlockSpec((None, None, None, c), lambda bi, hi, pi: (bi, hi, pi, 0)))
        out_shape.append(jax.ShapeDtypeStruct((b, h, p // bp, c), F32))
    outs = pl.pallas_call(
        functools.partial(_pass_kernel, reverse=reverse),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params("gpu", num_warps=prep.sizes.state_warps, num_stages=1),
        interpret=interpret_for("gpu", interpret),
    )(*args)
    dots = None if other is None else outs[2].sum(axis=2)
    return outs[0], outs[1], dots


def pass_states(prep, S_bchpn, h0_bhpn, interpret=None):
    """(H_in (b, c, h, p', n') entering each chunk in the matmul dtype, final state fp32)."""
    h_in, final, _ = _pass(prep, S_bchpn, h0_bhpn, reverse=False, interpret=interpret)
    return h_in, final


def pass_state_grads(prep, dS_bchpn, dfinal_bhpn, h_in, interpret=None):
    """Reverse: (dH_out (b, c, h, p', n') leaving each chunk, d initial state, and the
    per-chunk sums of dH_out * H_in (b, h, c): the decay's gradient through the carry)."""
    return _pass(prep, dS_bchpn, dfinal_bhpn, reverse=True, other=h_in, interpret=interpret)
