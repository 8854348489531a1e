"""The tpu (Mosaic) variant of the Pallas selective scan: grid (batch, channel block, chunk).

The chunk axis is sequential ("arbitrary"): the state (n, block_d), channels on lanes, lives
in the final-state output block, which stays in VMEM while its block index does not change,
and the backward keeps dh, dA and dD the same way in its own resident outputs. Each grid
step moves one chunk of x, dt, z (chunk, block_d) and B, C (chunk, n) into VMEM and runs the
steps of kernel.py on static row slices of those tiles. Outputs are assembled as whole tiles
by masked selects (no single-row stores into packed bf16 blocks) and written once per step.
Block shapes end in (8k, 128k) or whole axes: x-like blocks (chunk, block_d), B-like
(chunk, n), states (n, block_d), per-step dB / dC partials (n, chunk).
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

TPU_AXES = Axes(channel=1, state=0, keepdims=True)  # state tile (n, block_d): channels on lanes


def _tpu_steps(chunk, x_ref, dt_ref, z_ref, dout_ref, b_ref, c_ref):
    """The chunk's steps: per-channel (1, block_d) rows, per-state (n, 1) columns (fp32)."""
    tiles = [None if r is None else r[...].astype(F32) for r in (x_ref, dt_ref, z_ref, dout_ref)]
    b_tile, c_tile = b_ref[...].astype(F32), c_ref[...].astype(F32)
    n = b_tile.shape[1]
    eye = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0) == jax.lax.broadcasted_iota(
        jnp.int32, (n, n), 1
    )

    def column(tile, i):
        """Row i of a (chunk, n) tile as an (n, 1) column: a masked lane sum transposes it."""
        return jnp.sum(jnp.where(eye, tile[i : i + 1, :], 0.0), axis=1, keepdims=True)

    return [
        Step(
            *(None if t is None else t[i : i + 1, :] for t in tiles),
            column(b_tile, i),
            column(c_tile, i),
        )
        for i in range(chunk)
    ]


def _put(tile, axis, i, value):
    """tile with its row (axis 0) or column (axis 1) i replaced by `value`."""
    return jnp.where(jax.lax.broadcasted_iota(jnp.int32, tile.shape, axis) == i, value, tile)


def _tpu_forward_kernel(*refs, chunk, save_every, has_z, has_h0, save_states):
    """One chunk of one (batch row, channel block); the state carried in the hT block."""
    refs = list(refs)
    # inputs: x, dt (chunk, bd); z (chunk, bd) if has_z; B, C (chunk, n); A^T (n, bd);
    # D (1, bd); initial state (n, bd) if has_h0
    x_ref, dt_ref = refs.pop(0), refs.pop(0)
    z_ref = refs.pop(0) if has_z else None
    b_ref, c_ref, a_ref, d_ref = refs[:4]
    del refs[:4]
    h0_ref = refs.pop(0) if has_h0 else None
    # outputs: y (chunk, bd); final state (n, bd); the state every save_every steps
    # (chunk / save_every, n, bd) if save_states
    y_ref, hT_ref = refs.pop(0), refs.pop(0)
    hs_ref = refs.pop(0) if save_states else None

    @pl.when(pl.program_id(2) == 0)
    def _():
        hT_ref[...] = h0_ref[...] if has_h0 else jnp.zeros(hT_ref.shape, F32)

    h = hT_ref[...]
    A2, D = a_ref[...] * LOG2E, d_ref[...]
    out = {"y": jnp.zeros(y_ref.shape, F32)}
    steps = _tpu_steps(chunk, x_ref, dt_ref, z_ref, None, b_ref, c_ref)
    for j in range(chunk // save_every):
        if hs_ref is not None:
            hs_ref[j] = h

        def emit(i, y, j=j):
            out["y"] = _put(out["y"], 0, j * save_every + i, y)

        h = forward_steps(h, steps[j * save_every : (j + 1) * save_every], A2, D, TPU_AXES, emit)
    hT_ref[...] = h
    y_ref[...] = out["y"].astype(y_ref.dtype)


def _tpu_backward_kernel(*refs, chunk, has_z):
    """One chunk (last to first) of one (batch row, channel block); dh, dA, dD carried in
    their resident output blocks."""
    # inputs: x, dt (chunk, bd); z if has_z; dout (chunk, bd); B, C (chunk, n); A^T (n, bd);
    # D (1, bd); this chunk's start state (1, n, bd); the final-state cotangent (n, bd).
    # outputs: dx, ddt (chunk, bd); dz if has_z; dB, dC partials (n, chunk); dA (n, bd);
    # dD (1, bd); d initial state (n, bd)
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

    @pl.when(pl.program_id(2) == 0)
    def _():
        dh0_ref[...] = dfinal_ref[...]
        da_ref[...] = jnp.zeros(da_ref.shape, F32)
        dd_ref[...] = jnp.zeros(dd_ref.shape, F32)

    rows = jnp.zeros(dx_ref.shape, F32)
    cols = jnp.zeros(db_ref.shape, F32)
    out = dict(dx=rows, ddt=rows, dz=rows, dB=cols, dC=cols)

    def emit(i, g):
        for name in ("dx", "ddt") + ("dz",) * has_z:
            out[name] = _put(out[name], 0, i, getattr(g, name))
        for name in ("dB", "dC"):
            out[name] = _put(out[name], 1, i, getattr(g, name))

    A = a_ref[...]
    steps = _tpu_steps(chunk, x_ref, dt_ref, z_ref, dout_ref, b_ref, c_ref)
    dh0_ref[...], da_ref[...] = backward_steps(
        hs_ref[0], dh0_ref[...], da_ref[...], steps, A, A * LOG2E, d_ref[...], TPU_AXES, emit
    )
    z_tile = None if z_ref is None else z_ref[...]
    dd_ref[...] += chunk_dD(x_ref[...], z_tile, dout_ref[...], keepdims=True)
    dx_ref[...] = out["dx"].astype(dx_ref.dtype)
    ddt_ref[...] = out["ddt"].astype(ddt_ref.dtype)
    if dz_ref is not None:
        dz_ref[...] = out["dz"].astype(dz_ref.dtype)
    db_ref[...], dc_ref[...] = out["dB"], out["dC"]


def _tpu_specs(geo, reverse):
    """BlockSpecs of the grid (batch, channel block, chunk); reverse walks chunks backwards."""
    bd, n, k, last = geo.block_d, geo.n_pad, geo.chunk, geo.num_chunks - 1

    def t(c):
        """The chunk that grid step c visits."""
        return last - c if reverse else c

    return dict(
        seq=pl.BlockSpec((None, k, bd), lambda i, j, c: (i, t(c), j)),
        bc=pl.BlockSpec((None, k, n), lambda i, j, c: (i, t(c), 0)),
        A=pl.BlockSpec((n, bd), lambda i, j, c: (0, j)),
        D=pl.BlockSpec((1, bd), lambda i, j, c: (0, j)),
        state=pl.BlockSpec((None, n, bd), lambda i, j, c: (i, 0, j)),
        # forward: chunk / save_every saved states per chunk; backward: one (chunk = spacing)
        states=pl.BlockSpec((None, k // geo.save_every, n, bd), lambda i, j, c: (i, t(c), 0, j)),
        partial_bc=pl.BlockSpec((None, None, None, n, k), lambda i, j, c: (i, j, t(c), 0, 0)),
        per_channel=pl.BlockSpec((None, 1, bd), lambda i, j, c: (i, 0, j)),
    )


def _call(kernel, geo, b, in_specs, out_specs, out_shape, interpret):
    """pallas_call over (batch, channel block, chunk) with the chunk axis sequential."""
    return pl.pallas_call(
        kernel,
        grid=(b, geo.num_blocks, geo.num_chunks),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params(
            "tpu", dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        interpret=interpret_for("tpu", interpret),
    )


def _transposed(p):
    """A, D and the initial state in the lanes-are-channels layout."""
    h0 = None if p["h0"] is None else jnp.swapaxes(p["h0"], 1, 2)
    return p["A"].T, p["D"][None, :], h0


def tpu_forward(geo, p, *, save_states, interpret):
    """Forward on padded inputs: y (b, l', d'), final state (b, d', n'), the states every
    save_every steps (b, l' / save_every, n', d') or None."""
    b = p["x"].shape[0]
    s = _tpu_specs(geo, reverse=False)
    A_t, D_row, h0_t = _transposed(p)
    has_z, has_h0 = p["z"] is not None, h0_t is not None
    ins = [p["x"], p["dt"]] + [p["z"]] * has_z + [p["B"], p["C"], A_t, D_row]
    ins += [h0_t] * has_h0
    in_specs = [s["seq"]] * (2 + has_z) + [s["bc"], s["bc"], s["A"], s["D"]]
    in_specs += [s["state"]] * has_h0
    out_shape = [
        jax.ShapeDtypeStruct((b, geo.l_pad, geo.d_pad), p["x"].dtype),
        jax.ShapeDtypeStruct((b, geo.n_pad, geo.d_pad), F32),
    ]
    out_specs = [s["seq"], s["state"]]
    if save_states:
        out_shape.append(jax.ShapeDtypeStruct((b, geo.num_saved, geo.n_pad, geo.d_pad), F32))
        out_specs.append(s["states"])
    kernel = functools.partial(
        _tpu_forward_kernel,
        chunk=geo.chunk,
        save_every=geo.save_every,
        has_z=has_z,
        has_h0=has_h0,
        save_states=save_states,
    )
    outs = _call(kernel, geo, b, in_specs, out_specs, out_shape, interpret)(*ins)
    return outs[0], jnp.swapaxes(outs[1], 1, 2), (outs[2] if save_states else None)


def tpu_backward(geo, p, states, dout, dfinal, *, interpret):
    """Backward on padded inputs: dx, ddt, dz (b, l', d'); dB, dC (b, l', n'); dA (d', n');
    dD (d',); d initial state (b, d', n')."""
    b = p["x"].shape[0]
    s = _tpu_specs(geo, reverse=True)
    A_t, D_row, _ = _transposed(p)
    has_z = p["z"] is not None
    ins = [p["x"], p["dt"]] + [p["z"]] * has_z + [dout, p["B"], p["C"], A_t, D_row, states]
    ins.append(jnp.swapaxes(dfinal, 1, 2))
    in_specs = [s["seq"]] * (3 + has_z) + [s["bc"], s["bc"], s["A"], s["D"], s["states"]]
    in_specs.append(s["state"])
    seq_shape = (b, geo.l_pad, geo.d_pad)
    out_shape = [jax.ShapeDtypeStruct(seq_shape, p["x"].dtype)]
    out_shape += [jax.ShapeDtypeStruct(seq_shape, p["dt"].dtype)]
    if has_z:
        out_shape.append(jax.ShapeDtypeStruct(seq_shape, p["z"].dtype))
    partial = jax.ShapeDtypeStruct((b, geo.num_blocks, geo.num_chunks, geo.n_pad, geo.chunk), F32)
    state = jax.ShapeDtypeStruct((b, geo.n_pad, geo.d_pad), F32)
    out_shape += [partial, partial, state, jax.ShapeDtypeStruct((b, 1, geo.d_pad), F32), state]
    out_specs = [s["seq"]] * (2 + has_z) + [s["partial_bc"], s["partial_bc"], s["state"]]
    out_specs += [s["per_channel"], s["state"]]
    kernel = functools.partial(_tpu_backward_kernel, chunk=geo.chunk, has_z=has_z)
    outs = _call(kernel, geo, b, in_specs, out_specs, out_shape, interpret)(*ins)
    dx, ddt, *outs = outs
    dz = outs.pop(0) if has_z else None
    dB, dC, dA, dD, dh0 = outs

    def per_step(partial_bjcnk):
        """(b, blocks, chunks, n', chunk) partials -> (b, l', n') sums over the blocks."""
        return jnp.swapaxes(partial_bjcnk.sum(axis=1), 2, 3).reshape(b, geo.l_pad, geo.n_pad)

    return (
        dx,
        ddt,
        dz,
        per_step(dB),
        per_step(dC),
        dA.sum(axis=0).T,
        dD.sum(axis=(0, 1)),
        jnp.swapaxes(dh0, 1, 2),
    )
