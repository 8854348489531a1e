"""Mamba-1 selective scan (S6) in Pallas: the per-step math that its gpu (kernel_gpu.py) and tpu
(kernel_tpu.py) kernels share; pallas.py pads the inputs and picks the variant.

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
bf16 when B / C are bf16, see kernel_gpu.partial_dtype), dA and dD per batch row; dD
(= sum_t dout silu(z) x) is taken per chunk on whole tiles.

Both variants hold the state of one channel block as a 2-D fp32 tile and differ only in
which axis carries the channels: gpu (block_d, n), tpu (n, block_d) with channels on lanes.
Per-channel inputs (x, dt, z, dout) and per-state inputs (B, C) come as 2-D vectors that
broadcast against the tile, so the same code serves both layouts. The steps of a chunk are
unrolled in Python, so their loads, which do not depend on the state, can be issued ahead of
the steps that use them.
"""

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

F32 = jnp.float32
LOG2E = math.log2(math.e)  # exp(dt A) = exp2(dt A log2(e)): one multiply less per step


@dataclasses.dataclass(frozen=True)
class Axes:
    """Layout of a state tile: the axis of the channels (d), the axis of the state index (n),
    and whether per-channel and per-state vectors keep the tile's rank (tpu) or are 1-D
    (gpu: a 1-D reduction result feeds stores and elementwise ops in its own Triton layout,
    where a (block_d, 1) column would take a layout conversion through shared memory)."""

    channel: int
    state: int
    keepdims: bool

    def channel_tile(self, v):
        """A per-channel vector as an operand broadcasting against the tile."""
        return v if self.keepdims else jnp.expand_dims(v, self.state)

    def state_tile(self, v):
        """A per-state vector as an operand broadcasting against the tile."""
        return v if self.keepdims else jnp.expand_dims(v, self.channel)

    def sum_state(self, tile):
        """Sum over n: a per-channel vector."""
        return jnp.sum(tile, axis=self.state, keepdims=self.keepdims)

    def sum_channel(self, tile):
        """Sum over the block's channels: a per-state vector."""
        return jnp.sum(tile, axis=self.channel, keepdims=self.keepdims)


class Step(NamedTuple):
    """One time step's inputs in fp32: x, dt, z, dout per channel (z, dout may be None) and
    B, C per state, shaped as the tile's Axes shape such vectors."""

    x: jax.Array
    dt: jax.Array
    z: jax.Array | None
    dout: jax.Array | None
    B: jax.Array
    C: jax.Array


class StepGrads(NamedTuple):
    """One time step's gradients: dx, ddt, dz (None without z) per channel; dB, dC per state
    (partial sums over the block's channels)."""

    dx: jax.Array
    ddt: jax.Array
    dz: jax.Array | None
    dB: jax.Array
    dC: jax.Array


def forward_steps(h, steps, A2, D, axes, emit):
    """Advance state tile h over `steps`; emit(i, y_i) per step; return the last state.

    A2 = A log2(e) (a tile); D per channel; y_i = (C_i . h_i + D x_i) silu(z_i) in fp32."""
    ch, st = axes.channel_tile, axes.state_tile
    for i, s in enumerate(steps):
        h = jnp.exp2(ch(s.dt) * A2) * h + ch(s.dt * s.x) * st(s.B)
        y = axes.sum_state(h * st(s.C)) + D * s.x
        emit(i, y if s.z is None else y * silu(s.z))
    return h


def backward_steps(h_start, dh, dA, steps, A, A2, D, axes, emit):
    """Reverse mode of forward_steps from the chunk's start state h_start.

    dh: dL/dh at the chunk's last step (from later chunks); dA: running sum (a tile). The
    chunk's states are recomputed (`chunk` state tiles live at once), then emit(i, StepGrads)
    runs for i from last to first. Returns (dh before the chunk, dA).
    """
    ch, st = axes.channel_tile, axes.state_tile
    states = [h_start]
    for s in steps:
        states.append(jnp.exp2(ch(s.dt) * A2) * states[-1] + ch(s.dt * s.x) * st(s.B))
    for i in reversed(range(len(steps))):
        s, h_prev, h = steps[i], states[i], states[i + 1]
        decay = jnp.exp2(ch(s.dt) * A2)  # recomputed: cheaper than `chunk` more live tiles
        dy, dz = s.dout, None
        if s.z is not None:
            sig = jax.nn.sigmoid(s.z)
            y = axes.sum_state(h * st(s.C)) + D * s.x
            dz = s.dout * y * sig * (1.0 + s.z * (1.0 - sig))
            dy = s.dout * s.z * sig
        dh = dh + ch(dy) * st(s.C)
        ds = axes.sum_state(dh * st(s.B))
        g = dh * decay * h_prev
        emit(
            i,
            StepGrads(
                dx=s.dt * ds + D * dy,
                ddt=s.x * ds + axes.sum_state(g * A),
                dz=dz,
                dB=axes.sum_channel(dh * ch(s.dt * s.x)),
                dC=axes.sum_channel(ch(dy) * h),
            ),
        )
        dA = dA + g * ch(s.dt)
        dh = decay * dh
    return dh, dA


def chunk_dD(x, z, dout, keepdims):
    """dL/dD of one chunk from its (chunk, block_d) tiles: sum_t dout_t silu(z_t) x_t (fp32).

    Taken per chunk on whole tiles, apart from the steps: on gpu a per-step term would be
    computed again, loads included, in the layout of its accumulator (a layout of its own)."""
    x, dout = x.astype(F32), dout.astype(F32)
    dy = dout if z is None else dout * silu(z.astype(F32))
    return jnp.sum(dy * x, axis=0, keepdims=keepdims)


def silu(z):
    """z sigmoid(z)."""
    return z * jax.nn.sigmoid(z)


def split_backward_refs(refs, has_z):
    """The backward kernels' refs by name (both variants take them in this order): x, dt, z,
    dout, B, C, A, D, chunk-start states, final-state cotangent, then the outputs dx, ddt, dz,
    dB, dC, dA, dD, d initial state; z and dz are None unless has_z."""
    refs = list(refs)
    x_ref, dt_ref = refs.pop(0), refs.pop(0)
    z_ref = refs.pop(0) if has_z else None
    inputs = refs[:7]
    del refs[:7]
    dx_ref, ddt_ref = refs.pop(0), refs.pop(0)
    dz_ref = refs.pop(0) if has_z else None
    return (x_ref, dt_ref, z_ref, *inputs, dx_ref, ddt_ref, dz_ref, *refs)
