"""The Pallas selective scan between ops.py and the kernels: block sizes resolved, inputs padded
(tiling.py), the variant's kernels called (kernel_gpu.py, kernel_tpu.py), outputs cropped."""

import jax

from .kernel import F32
from .kernel_gpu import gpu_backward, gpu_forward, partial_dtype
from .kernel_tpu import tpu_backward, tpu_forward
from .tiling import BlockSizes, geometry, pad_to, padded_inputs, resolve_block_sizes


def _fit_channels(states, variant, d_pad):
    """Saved chunk-start states cropped or zero-padded to d_pad channels (gpu layout
    (b, c, d, n), tpu (b, c, n, d)): forward and backward may block channels differently."""
    axis = 2 if variant == "gpu" else 3
    states = jax.lax.slice_in_dim(states, 0, min(d_pad, states.shape[axis]), axis=axis)
    shape = list(states.shape)
    shape[axis] = d_pad
    return pad_to(states, tuple(shape))


def forward(
    x,
    dt,
    A,
    B,
    C,
    D=None,
    z=None,
    initial_state=None,
    *,
    variant,
    z_start=0,
    interpret=None,
    chunk=None,
    chunk_bwd=None,
    block_d=None,
    num_warps=None,
    save_states=False,
):
    """Pallas selective scan forward; same contract as selective_scan_reference.

    z may be wider than x, the gate its channels z_start .. z_start + d (read in place where the
    kernels allow: tiling.padded_inputs).
    Returns (y (b, l, d) in x.dtype, final state (b, d, n) fp32, states): states are the fp32
    states every chunk_bwd steps, the residual `backward` needs (None unless save_states).
    chunk, chunk_bwd, block_d, num_warps: tuning knobs (see BlockSizes), None =
    the variant's default; interpret: None = compiled on the variant's hardware only."""
    sizes = resolve_block_sizes(
        variant,
        BlockSizes(chunk=chunk, chunk_bwd=chunk_bwd, block_d=block_d, num_warps=num_warps),
    )
    _, l, d = x.shape
    n = A.shape[1]
    geo = geometry(variant, l, d, n, sizes.chunk, sizes.chunk_bwd, sizes.block_d)
    p = padded_inputs(geo, x, dt, A, B, C, D, z, initial_state, z_start=z_start, variant=variant)
    if variant == "gpu":
        y, final, states = gpu_forward(
            geo, p, save_states=save_states, num_warps=sizes.num_warps, interpret=interpret
        )
    else:
        y, final, states = tpu_forward(geo, p, save_states=save_states, interpret=interpret)
    if states is not None:
        states = _fit_channels(states, variant, d)
    return y[:, :l, :d], final[:, :d, :n], states


def backward(
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
    *,
    variant,
    z_start=0,
    interpret=None,
    chunk_bwd=None,
    block_d=None,
    num_warps=None,
):
    """Gradients of forward's (y, final state) given their cotangents dout, dfinal.

    `states` comes from forward(..., save_states=True) with the same chunk_bwd, which is the
    length of the backward's chunks. Returns (dx, ddt, dA, dB, dC, dD, dz, d initial_state):
    dx, ddt, dz in the dtypes of x, dt, z, the rest fp32 (dz (b, l, d): the gate's, z_start as
    `forward`'s); dz and d initial_state are None when z and initial_state are."""
    sizes = resolve_block_sizes(
        variant,
        BlockSizes(chunk=chunk_bwd, chunk_bwd=chunk_bwd, block_d=block_d, num_warps=num_warps),
    )
    b, l, d = x.shape
    n = A.shape[1]
    geo = geometry(variant, l, d, n, sizes.chunk_bwd, sizes.chunk_bwd, sizes.block_d)
    if states.shape[1] < geo.num_chunks:
        raise ValueError(
            f"states hold {states.shape[1]} saved states, chunk_bwd={geo.chunk} needs "
            f"{geo.num_chunks}: call backward with forward's chunk_bwd"
        )
    p = padded_inputs(geo, x, dt, A, B, C, D, z, initial_state, z_start=z_start, variant=variant)
    # The forward may have padded further (to its longer chunks): drop the states it saved
    # in that padding.
    states = _fit_channels(states[:, : geo.num_chunks], variant, geo.d_pad)
    dout = pad_to(dout, (b, geo.l_pad, geo.d_pad))
    dfinal = pad_to(dfinal.astype(F32), (b, geo.d_pad, geo.n_pad))
    if variant == "gpu":
        partial_dtypes = (partial_dtype(B.dtype), partial_dtype(C.dtype))
        grads = gpu_backward(
            geo,
            p,
            states,
            dout,
            dfinal,
            partial_dtypes=partial_dtypes,
            num_warps=sizes.num_warps,
            interpret=interpret,
        )
    else:
        grads = tpu_backward(geo, p, states, dout, dfinal, interpret=interpret)
    dx, ddt, dz, dB, dC, dA, dD, dh0 = grads
    seq = (slice(None), slice(0, l), slice(0, d))
    return (
        dx[seq],
        ddt[seq],
        dA[:d, :n],
        dB[:, :l, :n],
        dC[:, :l, :n],
        dD[:d],
        None if dz is None else dz[seq],
        None if initial_state is None else dh0[:, :d, :n],
    )
