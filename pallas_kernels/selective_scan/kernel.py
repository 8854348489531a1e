"""Mamba-1 selective scan (S6) in Pallas: one fused forward scan, one fused reverse scan.

The state h (d, n) stays on chip: the discretisation (exp(dt A), dt B x) happens inside the
kernel, and only y, the final state and, for the backward, the state every chunk_bwd steps
(b, l / chunk_bwd, d, n), fp32, are written; nothing of size (b, l, d, n) ever is. Time runs
in chunks of `chunk` steps whose inputs are all loaded before the chunk's steps run, so the
loads wait on nothing and their latency is paid once per chunk, not once per step.

Backward (reverse mode of reference.py's recurrence): chunks of chunk_bwd steps, last to
first; each chunk's states are recomputed from its saved start, then its steps run backwards
carrying dh:
    dh_t += dy_t C_t,   dy = dout silu(z)          dC_t = sum_d dy_t h_t
    dB_t  = sum_d dh_t dt_t x_t                    s_t  = sum_n dh_t B_t
    g_t   = dh_t exp(dt_t A) h_{t-1}   (the gradient of dt_t A, elementwise)
    dx_t  = dt_t s_t + D dy_t          ddt_t = x_t s_t + sum_n g_t A          dA += g_t dt_t
    dh_{t-1} = exp(dt_t A) dh_t
dB and dC come out per channel block and are summed in JAX in fp32 (gpu: the partials in
bf16 when B / C are bf16, see _partial_dtype), dA and dD per batch row; dD
(= sum_t dout silu(z) x) is taken per chunk on whole tiles.

Variants share the per-step math (steps.py) on 2-D tiles whose channel and state axes they
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
from .kernel_tpu import tpu_backward, tpu_forward
from .steps import (
    F32,
    LOG2E,
    Axes,
    Step,
    backward_steps,
    chunk_dD,
    forward_steps,
    split_backward_refs,
)
from .tiling import BlockSizes, geometry, pad_to, padded_inputs, resolve_block_sizes

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
    (x_ref, dt_ref, z_ref, dout_ref, b_ref, c_ref, a_ref, d_ref, hs_ref, dfinal_ref, dx_ref,
     ddt_ref, dz_ref, db_ref, dc_ref, da_ref, dd_ref, dh0_ref) = split_backward_refs(
        refs, has_z)  # fmt: skip

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


def _gpu_specs(geo):
    """BlockSpecs of the gpu grid (batch, channel block): whole sequences per program."""
    bd, n, l = geo.block_d, geo.n_pad, geo.l_pad
    return dict(
        seq=pl.BlockSpec((None, l, bd), lambda i, j: (i, 0, j)),
        bc=pl.BlockSpec((None, l, n), lambda i, j: (i, 0, 0)),
        A=pl.BlockSpec((bd, n), lambda i, j: (j, 0)),
        D=pl.BlockSpec((bd,), lambda i, j: (j,)),
        state=pl.BlockSpec((None, bd, n), lambda i, j: (i, j, 0)),
        states=pl.BlockSpec((None, geo.num_saved, bd, n), lambda i, j: (i, 0, j, 0)),
        partial_bc=pl.BlockSpec((None, None, l, n), lambda i, j: (i, j, 0, 0)),
        per_channel=pl.BlockSpec((None, bd), lambda i, j: (i, j)),
    )


def _gpu_forward(geo, p, *, save_states, num_warps, interpret):
    """pallas_call of the gpu forward on padded inputs: (y, final, chunk-start states)."""
    b = p["x"].shape[0]
    s = _gpu_specs(geo)
    names = ["x", "dt"] + ["z"] * (p["z"] is not None) + ["B", "C", "A", "D"]
    names += ["h0"] * (p["h0"] is not None)
    spec_of = dict(x="seq", dt="seq", z="seq", B="bc", C="bc", A="A", D="D", h0="state")
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


def _partial_dtype(dtype):
    """dtype of the gpu backward's per-channel-block dB or dC partials for B or C of `dtype`.

    bf16 for bf16 B / C: the partials (2 x (b, l, n) per 8 channels, 1.34 GB each in fp32 at
    (2, 8192, 5120, 16)) are written and summed at memory speed, and in bf16 the backward plus
    their sum took 4.34 + 0.24 ms instead of 4.77 + 0.44 (H100). Each 8-channel partial is
    rounded once, which adds about half again to the error of rounding the exact result to
    bf16 (relative rms 2.7e-3 vs 1.7e-3 in the test pinning it). fp32 otherwise (fp16 would
    also lose range)."""
    return jnp.bfloat16 if jnp.dtype(dtype) == jnp.bfloat16 else F32


def _gpu_backward(geo, p, states, dout, dfinal, *, partial_dtypes, num_warps, interpret):
    """pallas_call of the gpu backward: dx, ddt, dz, dB/dC (from partials of partial_dtypes
    summed in fp32), dA/dD per row, dh0."""
    b = p["x"].shape[0]
    s = _gpu_specs(geo)
    has_z = p["z"] is not None
    seq_shape = (b, geo.l_pad, geo.d_pad)
    ins = [p["x"], p["dt"]] + [p["z"]] * has_z + [dout, p["B"], p["C"], p["A"], p["D"]]
    ins += [states, dfinal]
    in_specs = [s["seq"]] * (3 + has_z) + [s["bc"], s["bc"], s["A"], s["D"], s["states"]]
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


# ---------------------------------------------------------------- entry points


def _fit_channels(states, variant, d_pad):
    """Saved chunk-start states cropped or zero-padded to d_pad channels (gpu layout
    (b, c, d, n), tpu (b, c, n, d)): forward and backward may block channels differently."""
    axis = 2 if variant == "gpu" else 3
    states = jax.lax.slice_in_dim(states, 0, min(d_pad, states.shape[axis]), axis=axis)
    shape = list(states.shape)
    shape[axis] = d_pad
    return pad_to(states, tuple(shape))


def forward(
    x, dt, A, B, C, D=None, z=None, initial_state=None, *, variant, interpret=None,
    chunk=None, chunk_bwd=None, block_d=None, num_warps=None, save_states=False,
):  # fmt: skip
    """Pallas selective scan forward; same contract as selective_scan_reference.

    Returns (y (b, l, d) in x.dtype, final state (b, d, n) fp32, states): states are the fp32
    states every chunk_bwd steps, the residual `backward` needs (None unless save_states).
    chunk, chunk_bwd, block_d, num_warps: tuning knobs (see BlockSizes), None =
    the variant's default; interpret: None = compiled on the variant's hardware only."""
    sizes = resolve_block_sizes(
        variant,
        BlockSizes(chunk=chunk, chunk_bwd=chunk_bwd, block_d=block_d, num_warps=num_warps),
    )  # fmt: skip
    _, l, d = x.shape
    n = A.shape[1]
    geo = geometry(variant, l, d, n, sizes.chunk, sizes.chunk_bwd, sizes.block_d)
    p = padded_inputs(geo, x, dt, A, B, C, D, z, initial_state)
    if variant == "gpu":
        y, final, states = _gpu_forward(
            geo, p, save_states=save_states, num_warps=sizes.num_warps, interpret=interpret
        )
    else:
        y, final, states = tpu_forward(geo, p, save_states=save_states, interpret=interpret)
    if states is not None:
        states = _fit_channels(states, variant, d)
    return y[:, :l, :d], final[:, :d, :n], states


def backward(
    x, dt, A, B, C, D, z, initial_state, states, dout, dfinal, *, variant, interpret=None,
    chunk_bwd=None, block_d=None, num_warps=None,
):  # fmt: skip
    """Gradients of forward's (y, final state) given their cotangents dout, dfinal.

    `states` comes from forward(..., save_states=True) with the same chunk_bwd, which is the
    length of the backward's chunks. Returns (dx, ddt, dA, dB, dC, dD, dz, d initial_state):
    dx, ddt, dz in the dtypes of x, dt, z, the rest fp32; dz and d initial_state are None
    when z and initial_state are."""
    sizes = resolve_block_sizes(
        variant,
        BlockSizes(chunk=chunk_bwd, chunk_bwd=chunk_bwd, block_d=block_d, num_warps=num_warps),
    )  # fmt: skip
    b, l, d = x.shape
    n = A.shape[1]
    geo = geometry(variant, l, d, n, sizes.chunk_bwd, sizes.chunk_bwd, sizes.block_d)
    if states.shape[1] < geo.num_chunks:
        raise ValueError(
            f"states hold {states.shape[1]} saved states, chunk_bwd={geo.chunk} needs "
            f"{geo.num_chunks}: call backward with forward's chunk_bwd"
        )
    p = padded_inputs(geo, x, dt, A, B, C, D, z, initial_state)
    # The forward may have padded further (to its longer chunks): drop the states it saved
    # in that padding.
    states = _fit_channels(states[:, : geo.num_chunks], variant, geo.d_pad)
    dout = pad_to(dout, (b, geo.l_pad, geo.d_pad))
    dfinal = pad_to(dfinal.astype(F32), (b, geo.d_pad, geo.n_pad))
    if variant == "gpu":
        partial_dtypes = (_partial_dtype(B.dtype), _partial_dtype(C.dtype))
        grads = _gpu_backward(
            geo, p, states, dout, dfinal, partial_dtypes=partial_dtypes,
            num_warps=sizes.num_warps, interpret=interpret,
        )  # fmt: skip
    else:
        grads = tpu_backward(geo, p, states, dout, dfinal, interpret=interpret)
    dx, ddt, dz, dB, dC, dA, dD, dh0 = grads
    seq = (slice(None), slice(0, l), slice(0, d))
    return (
        dx[seq], ddt[seq], dA[:d, :n], dB[:, :l, :n], dC[:, :l, :n], dD[:d],
        None if dz is None else dz[seq],
        None if initial_state is None else dh0[:, :d, :n],
    )  # fmt: skip
