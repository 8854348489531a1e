"""The gpu (Triton) variant of the Pallas selective scan (the algorithm: kernel.py).

Variants share the per-step math (kernel.py) on 2-D tiles whose channel and state axes they
choose: "gpu" (Triton, this file) holds the state (block_d, n) in registers, grid (batch,
channel blocks), chunks looped inside the kernel, per-step outputs and saved states gathered
into one tile per chunk and stored once (small stores cost far more than their bytes: one
store per 4 steps instead of per 16 made the forward 1.3x slower); "tpu" (Mosaic,
kernel_tpu.py) holds it (n, block_d) with channels on lanes, grid (batch, channel blocks,
chunks) with the chunk axis sequential. Tiling: tiling.py.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ..backend import compiler_params, interpret_for
from .kernel import (
    F32,
    LOG2E,
    Axes,
    Step,
    backward_steps,
    chunk_dD,
    forward_steps,
    split_backward_refs,
)

# ---------------------------------------------------------------- gpu (Triton) kernels

GPU_AXES = Axes(channel=0, state=1, keepdims=False)  # state tile (block_d, n)


class _LazyStep:
    """A Step whose rows are loaded at their first use: the backward's reverse pass loads z,
    dout and C only when it reaches the step, instead of keeping them live through the
    recompute pass."""

    def __init__(self, t, refs):
        self._t, self._refs = t, refs

    def __getattr__(self, name):
        ref = self._refs[name]
        value = None if ref is None else ref[self._t, :].astype(F32)
        setattr(self, name, value)  # later reads find the attribute: one load per row
        return value


def _gpu_steps(t0, chunk, x_ref, dt_ref, z_ref, dout_ref, b_ref, c_ref, *, lazy=False):
    """The steps t0 .. t0 + chunk - 1; lazy=False loads every row now, before any step runs
    (the forward: all loads of the chunk in flight together)."""
    refs = dict(x=x_ref, dt=dt_ref, z=z_ref, dout=dout_ref, B=b_ref, C=c_ref)
    steps = [_LazyStep(t0 + i, refs) for i in range(chunk)]
    if lazy:
        return steps
    return [Step(*(getattr(s, name) for name in Step._fields)) for s in steps]


def _put(tile, axis, i, v):
    """tile with its column (axis 1: v per channel) or row (axis 0: v per state) i set to v.

    Per-step outputs are gathered into one tile per chunk and stored once: a (block_d,) vector
    stored on its own would first move through shared memory (a barrier every step), while
    these selects stay in the state tile's register layout."""
    v = jnp.expand_dims(v, axis)
    return jnp.where(jax.lax.broadcasted_iota(jnp.int32, tile.shape, axis) == i, v, tile)


def _gpu_forward_kernel(*refs, chunk, num_chunks, save_every, has_z, has_h0, save_states):
    """One (batch row, channel block): all chunks in order, the state in registers."""
    refs = list(refs)
    # inputs: x, dt (l, bd); z (l, bd) if has_z; B, C (l, n); A (bd, n); D (bd,); h0 (bd, n)
    x_ref, dt_ref = refs.pop(0), refs.pop(0)
    z_ref = refs.pop(0) if has_z else None
    b_ref, c_ref, a_ref, d_ref = refs[:4]
    del refs[:4]
    h0_ref = refs.pop(0) if has_h0 else None
    # outputs: y (l, bd); final state (bd, n); the state every save_every steps
    # (l / save_every, bd, n) if save_states
    y_ref, hT_ref = refs.pop(0), refs.pop(0)
    hs_ref = refs.pop(0) if save_states else None

    A = a_ref[...]
    A2, D = A * LOG2E, d_ref[...]
    bd = A.shape[0]
    per_chunk = chunk // save_every

    def chunk_body(c, h):
        """Scan chunk c from state h."""
        t0 = pl.multiple_of(c * chunk, chunk)
        steps = _gpu_steps(t0, chunk, x_ref, dt_ref, z_ref, None, b_ref, c_ref)
        out = {"y": jnp.zeros((bd, chunk), F32)}
        # Saved states gathered, stored once per chunk (H100, (2, 8192, 5120, 16): forward
        # 2.49 ms, 3.23 storing each on its own).
        saved = jnp.zeros((per_chunk, bd, A.shape[1]), F32)
        for j in range(per_chunk):
            saved = _put(saved, 0, j, h)

            def emit(i, y, j=j):
                out["y"] = _put(out["y"], 1, j * save_every + i, y)

            part = steps[j * save_every : (j + 1) * save_every]
            h = forward_steps(h, part, A2, D, GPU_AXES, emit)
        y_ref[pl.ds(t0, chunk), :] = out["y"].T.astype(y_ref.dtype)
        if hs_ref is not None:
            hs_ref[pl.ds(c * per_chunk, per_chunk)] = saved
        return h

    h = h0_ref[...] if has_h0 else jnp.zeros(A.shape, F32)
    hT_ref[...] = jax.lax.fori_loop(0, num_chunks, chunk_body, h)


def _gpu_backward_kernel(*refs, chunk, num_chunks, has_z):
    """One (batch row, channel block): chunks last to first, dh, dA, dD in registers."""
    # inputs: x, dt (l, bd); z if has_z; dout (l, bd); B, C (l, n); A (bd, n); D (bd,); the
    # chunk-start states; the final-state cotangent (bd, n). outputs: dx, ddt (l, bd); dz if
    # has_z; dB, dC partials (l, n); dA (bd, n); dD (bd,); d initial state (bd, n)
    (
        x_ref,
        dt_ref,
        z_ref,
        dout_ref,
        b_ref,
        c_ref,
        a_ref,
        d_ref,
        hs_ref,
        dfinal_ref,
        dx_ref,
        ddt_ref,
        dz_ref,
        db_ref,
        dc_ref,
        da_ref,
        dd_ref,
        dh0_ref,
    ) = split_backward_refs(refs, has_z)

    A = a_ref[...]
    A2, D = A * LOG2E, d_ref[...]
    bd, n = A.shape
    per_channel = {"dx": dx_ref, "ddt": ddt_ref, "dz": dz_ref}  # dz_ref None without z
    per_state = {"dB": db_ref, "dC": dc_ref}

    def chunk_body(k, carry):
        """Back-propagate through chunk num_chunks - 1 - k."""
        dh, dA, dD = carry
        c = num_chunks - 1 - k
        t0 = pl.multiple_of(c * chunk, chunk)
        steps = _gpu_steps(t0, chunk, x_ref, dt_ref, z_ref, dout_ref, b_ref, c_ref, lazy=True)
        channel_tiles = [name for name, r in per_channel.items() if r is not None]
        out = {name: jnp.zeros((bd, chunk), F32) for name in channel_tiles}
        out.update({name: jnp.zeros((chunk, n), F32) for name in per_state})

        def emit(i, g):
            for name in out:
                out[name] = _put(out[name], 1 if name in channel_tiles else 0, i, getattr(g, name))

        dh, dA = backward_steps(hs_ref[c], dh, dA, steps, A, A2, D, GPU_AXES, emit)
        rows = pl.ds(t0, chunk)
        for name, tile in out.items():
            if name in per_state:
                per_state[name][rows, :] = tile.astype(per_state[name].dtype)
            else:
                per_channel[name][rows, :] = tile.T.astype(per_channel[name].dtype)
        z_tile = None if z_ref is None else z_ref[rows, :]
        return dh, dA, dD + chunk_dD(x_ref[rows, :], z_tile, dout_ref[rows, :], keepdims=False)

    init = (dfinal_ref[...], jnp.zeros(A.shape, F32), jnp.zeros(D.shape, F32))
    dh, dA, dD = jax.lax.fori_loop(0, num_chunks, chunk_body, init)
    dh0_ref[...] = dh
    da_ref[...] = dA
    dd_ref[...] = dD


def _gpu_specs(geo, z_block=0):
    """BlockSpecs of the gpu grid (batch, channel block): whole sequences per program; the gate
    from channel block `z_block` of its array on."""
    bd, n, l = geo.block_d, geo.n_pad, geo.l_pad
    return dict(
        seq=pl.BlockSpec((None, l, bd), lambda i, j: (i, 0, j)),
        z=pl.BlockSpec((None, l, bd), lambda i, j: (i, 0, j + z_block)),
        bc=pl.BlockSpec((None, l, n), lambda i, j: (i, 0, 0)),
        A=pl.BlockSpec((bd, n), lambda i, j: (j, 0)),
        D=pl.BlockSpec((bd,), lambda i, j: (j,)),
        state=pl.BlockSpec((None, bd, n), lambda i, j: (i, j, 0)),
        states=pl.BlockSpec((None, geo.num_saved, bd, n), lambda i, j: (i, 0, j, 0)),
        partial_bc=pl.BlockSpec((None, None, l, n), lambda i, j: (i, j, 0, 0)),
        per_channel=pl.BlockSpec((None, bd), lambda i, j: (i, j)),
    )


def gpu_forward(geo, p, *, save_states, num_warps, interpret):
    """pallas_call of the gpu forward on padded inputs: (y, final, chunk-start states)."""
    b = p["x"].shape[0]
    s = _gpu_specs(geo, p["z_block"])
    names = ["x", "dt"] + ["z"] * (p["z"] is not None) + ["B", "C", "A", "D"]
    names += ["h0"] * (p["h0"] is not None)
    spec_of = dict(x="seq", dt="seq", z="z", B="bc", C="bc", A="A", D="D", h0="state")
    out_shape = [
        jax.ShapeDtypeStruct((b, geo.l_pad, geo.d_pad), p["x"].dtype),
        jax.ShapeDtypeStruct((b, geo.d_pad, geo.n_pad), F32),
    ]
    out_specs = [s["seq"], s["state"]]
    if save_states:
        out_shape.append(jax.ShapeDtypeStruct((b, geo.num_saved, geo.d_pad, geo.n_pad), F32))
        out_specs.append(s["states"])
    kernel = functools.partial(
        _gpu_forward_kernel,
        chunk=geo.chunk,
        num_chunks=geo.num_chunks,
        save_every=geo.save_every,
        has_z=p["z"] is not None,
        has_h0=p["h0"] is not None,
        save_states=save_states,
    )
    outs = pl.pallas_call(
        kernel,
        grid=(b, geo.num_blocks),
        in_specs=[s[spec_of[k]] for k in names],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params("gpu", num_warps=num_warps, num_stages=1),
        interpret=interpret_for("gpu", interpret),
    )(*[p[k] for k in names])
    return outs[0], outs[1], (outs[2] if save_states else None)


def partial_dtype(dtype):
    """dtype of the gpu backward's per-channel-block dB or dC partials for B or C of `dtype`.

    bf16 for bf16 B / C: the partials (2 x (b, l, n) per 8 channels, 1.34 GB each in fp32 at
    (2, 8192, 5120, 16)) are written and summed at memory speed, and in bf16 the backward plus
    their sum took 4.34 + 0.24 ms instead of 4.77 + 0.44 (H100). Each 8-channel partial is
    rounded once, which adds about half again to the error of rounding the exact result to
    bf16 (relative rms 2.7e-3 vs 1.7e-3 in the test pinning it). fp32 otherwise (fp16 would
    also lose range)."""
    return jnp.bfloat16 if jnp.dtype(dtype) == jnp.bfloat16 else F32


def gpu_backward(geo, p, states, dout, dfinal, *, partial_dtypes, num_warps, interpret):
    """pallas_call of the gpu backward: dx, ddt, dz, dB/dC (from partials of partial_dtypes
    summed in fp32), dA/dD per row, dh0."""
    b = p["x"].shape[0]
    s = _gpu_specs(geo, p["z_block"])
    has_z = p["z"] is not None
    seq_shape = (b, geo.l_pad, geo.d_pad)
    ins = [p["x"], p["dt"]] + [p["z"]] * has_z + [dout, p["B"], p["C"], p["A"], p["D"]]
    ins += [states, dfinal]
    in_specs = [s["seq"], s["seq"]] + [s["z"]] * has_z + [s["seq"], s["bc"], s["bc"]]
    in_specs += [s["A"], s["D"], s["states"]]
    in_specs.append(s["state"])
    out_shape = [jax.ShapeDtypeStruct(seq_shape, p["x"].dtype)]
    out_shape += [jax.ShapeDtypeStruct(seq_shape, p["dt"].dtype)]
    if has_z:
        out_shape.append(jax.ShapeDtypeStruct(seq_shape, p["z"].dtype))
    partials = [
        jax.ShapeDtypeStruct((b, geo.num_blocks, geo.l_pad, geo.n_pad), dtype)
        for dtype in partial_dtypes
    ]
    state = jax.ShapeDtypeStruct((b, geo.d_pad, geo.n_pad), F32)
    out_shape += [*partials, state, jax.ShapeDtypeStruct((b, geo.d_pad), F32), state]
    out_specs = [s["seq"]] * (2 + has_z) + [s["partial_bc"], s["partial_bc"], s["state"]]
    out_specs += [s["per_channel"], s["state"]]
    kernel = functools.partial(
        _gpu_backward_kernel, chunk=geo.chunk, num_chunks=geo.num_chunks, has_z=has_z
    )
    outs = pl.pallas_call(
        kernel,
        grid=(b, geo.num_blocks),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params("gpu", num_warps=num_warps, num_stages=1),
        interpret=interpret_for("gpu", interpret),
    )(*ins)
    dx, ddt, *outs = outs
    dz = outs.pop(0) if has_z else None
    dB, dC, dA, dD, dh0 = outs
    dB, dC = (partial.sum(axis=1, dtype=F32) for partial in (dB, dC))
    return dx, ddt, dz, dB, dC, dA.sum(axis=0), dD.sum(axis=0), dh0
