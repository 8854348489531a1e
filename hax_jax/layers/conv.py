"""Depthwise causal conv1d over (b, l, c), with its window as explicit state."""

import functools
import itertools

import jax
import jax.numpy as jnp
from flax import nnx

from hax_jax.layers.init import torch_linear_init
from hax_jax.parallel import (
    from_last_shard,
    from_previous_shard,
    on_first_shard,
    per_device,
    seq_shards,
)
from pallas_kernels.backend import auto_picks_pallas
from pallas_kernels.conv1d import causal_conv1d_pallas
from pallas_kernels.conv1d import supports as conv_kernels_take


class CausalConv1d(nnx.Module):
    """Depthwise causal conv: y_t = bias + sum_j kernel[j] * x_{t - (width - 1) + j}, per channel.

    The state is the previous `width - 1` inputs (zeros at the start of a sequence), so a sequence
    may be processed in pieces, or one token at a time, with the same result.
    """

    def __init__(
        self,
        channels: int,
        width: int,
        *,
        use_bias: bool = True,
        impl: str = "auto",
        rngs: nnx.Rngs,
    ):
        init = torch_linear_init(width)  # torch Conv1d with groups=channels: fan_in = width
        # Depthwise: channels split over "tensor" need no communication; taps are never split.
        self.kernel = nnx.Param(
            init(rngs.params(), (width, channels)), logical_axes=(None, "inner")
        )
        self.bias = (
            nnx.Param(init(rngs.params(), (channels,)), logical_axes=("inner",))
            if use_bias
            else None
        )
        self.width, self.impl = width, impl  # impl: as `causal_conv1d`'s

    def init_state(self, batch: int, dtype) -> jax.Array:
        """The zero window (b, width - 1, c)."""
        return jnp.zeros((batch, self.width - 1, self.kernel.shape[1]), dtype)

    def __call__(
        self, x: jax.Array, *, state: jax.Array | None = None, seq_idx: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """x (b, l, c), state (b, width-1, c), seq_idx (b, l) -> (y (b, l, c), new state).

        With `seq_idx`, no window reaches across a document boundary; the incoming state belongs to
        the first document of the row. Under a mesh with a split "seq" axis each shard takes the
        previous shard's last width - 1 inputs as its window (a halo; hax_jax.parallel).
        """
        bias = None if self.bias is None else self.bias[...]
        return per_device(
            functools.partial(conv_shard, impl=self.impl),
            dict(x=x, kernel=self.kernel[...], bias=bias, state=state, seq_idx=seq_idx),
            dict(
                x=("batch", "seq", "inner"),
                kernel=(None, "inner"),
                bias=("inner",),
                state=("batch", None, "inner"),
                seq_idx=("batch", "seq"),
            ),
            [("batch", "seq", "inner"), ("batch", None, "inner")],
            seq_aware=True,
        )

    def step(
        self, x: jax.Array, state: jax.Array, *, silu: bool = False
    ) -> tuple[jax.Array, jax.Array]:
        """One token: x (b, c), state (b, width-1, c) -> (y (b, c), new state); `silu` as
        `causal_conv1d`'s."""
        window = jnp.concatenate([state.astype(x.dtype), x[:, None]], axis=1).astype(jnp.float32)
        y = jnp.einsum("bkc,kc->bc", window, self.kernel[...].astype(jnp.float32))
        if self.bias is not None:
            y = y + self.bias[...]
        if silu:
            y = jax.nn.silu(y)
        return y.astype(x.dtype), window[:, 1:].astype(x.dtype)


def conv_shard(
    x,
    kernel,
    bias,
    state,
    seq_idx,
    previous=None,
    *,
    silu=False,
    start=0,
    parts=None,
    impl="auto",
):
    """`causal_conv1d` of this shard of the sequence: its window comes from the previous shard
    (or `state` on the first; None: zeros); the new state is the last shard's. `previous`: the
    previous shard's last width - 1 inputs where the caller has them already (None: they are
    passed here from x). silu, start, parts, impl: as `causal_conv1d`'s."""
    k, c = kernel.shape
    if state is None:
        # Made here, not passed into shard_map: a zero window XLA can see folds into a pad of x;
        # an opaque operand makes it copy [state | x] (3.3 ms a step at 130M, data=2 on H100s).
        state = jnp.zeros((x.shape[0], k - 1, c), x.dtype)
    if seq_shards() > 1 and x.shape[1] < k - 1:
        raise ValueError(
            f"each sequence shard holds {x.shape[1]} positions, fewer than the conv's "
            f"width - 1 = {k - 1}: use fewer seq shards or a longer sequence"
        )
    if previous is None:
        tail = x[:, x.shape[1] - (k - 1) :, start : start + c]
        state = from_previous_shard(tail.astype(state.dtype), state)
    elif seq_shards() > 1:
        state = on_first_shard(state, previous.astype(state.dtype))
    state_seq_idx = None
    if seq_idx is not None:
        first = jnp.repeat(seq_idx[:, :1], k - 1, axis=1)  # the state's document: the first one
        state_seq_idx = from_previous_shard(seq_idx[:, seq_idx.shape[1] - (k - 1) :], first)
    y, new_state = causal_conv1d(
        x,
        kernel,
        bias,
        state,
        seq_idx,
        state_seq_idx,
        silu=silu,
        start=start,
        parts=parts,
        impl=impl,
    )
    return y, from_last_shard(new_state)


def causal_conv1d(
    x,
    kernel,
    bias,
    state,
    seq_idx=None,
    state_seq_idx=None,
    *,
    silu=False,
    start=0,
    parts=None,
    impl="auto",
):
    """y_t = bias + sum_j kernel[j] x_{t - (k-1) + j} over [state | x] (b, k - 1 + l, c), with
    taps across a change of seq_idx (state_seq_idx: the window's documents) zeroed; with `silu`,
    SiLU(y_t) taken in fp32 and rounded once (as mamba_ssm's causal_conv1d_fn(activation="silu")).
    -> (y, the new state).

    x may be wider than the conv's c = kernel.shape[1] channels, which are x's start .. start + c
    (a projection's whole output: the kernels read it in place, where a slice would be copied for
    them). parts: widths summing to c; y is then a tuple of them (the kernels write each apart).
    impl: "pallas" (pallas_kernels/conv1d: l a multiple of its ROWS-row chunks, k <= ROWS),
    "reference" (this function's arithmetic below, their definition) or "auto" (the kernels
    where they run compiled and take l and k, else the reference).

    Computed as x's conv after k - 1 zeros (a pad XLA reads in place) plus the window's taps on
    the first k - 1 outputs: [state | x] itself is never built, which for a halo from the
    previous shard cost a copy of x per layer (6.7 ms of a 97 ms step at 1 x 32768, seq = 2)."""
    b, l, _ = x.shape
    k, c = kernel.shape
    if impl not in ("auto", "pallas", "reference"):
        raise ValueError(f"conv impl must be 'auto', 'pallas' or 'reference', got {impl!r}")
    if impl == "auto":
        impl = "pallas" if auto_picks_pallas() and conv_kernels_take(l, k) else "reference"
    if impl == "pallas":
        # The Triton kernels: one pass each way (pallas_kernels/conv1d, which refuses a TPU and
        # rows it does not take); this function's own arithmetic below is their definition.
        y = causal_conv1d_pallas(
            x, kernel, bias, state, seq_idx, state_seq_idx, silu=silu, start=start, parts=parts
        )
        x_end = x[:, max(0, l - (k - 1)) :, start : start + c]
        return y, _new_state(x_end, state, seq_idx, state_seq_idx)
    x = x[..., start : start + c]
    m = min(l, k - 1)  # outputs whose window reaches into the state
    kernel = kernel.astype(jnp.float32)
    xp = jnp.pad(x, ((0, 0), (k - 1, 0), (0, 0))).astype(jnp.float32)
    sp = jnp.pad(state.astype(x.dtype), ((0, 0), (0, m), (0, 0))).astype(jnp.float32)
    if seq_idx is not None:
        seq_p = jnp.concatenate([state_seq_idx, seq_idx], axis=1)
    y = jnp.zeros((b, l, c), jnp.float32)
    y_state = jnp.zeros((b, m, c), jnp.float32)
    for j in range(k):  # tap j reads x_{t - (k-1) + j}
        tap = xp[:, j : j + l] * kernel[j]
        tap_state = sp[:, j : j + m] * kernel[j]
        if seq_idx is not None:
            same = (seq_p[:, j : j + l] == seq_idx)[..., None]
            tap = jnp.where(same, tap, 0.0)
            tap_state = jnp.where(same[:, :m], tap_state, 0.0)
        y = y + tap
        y_state = y_state + tap_state
    y = y + jnp.pad(y_state, ((0, 0), (0, l - m), (0, 0)))
    if bias is not None:
        y = y + bias
    if silu:
        y = jax.nn.silu(y)
    y = y.astype(x.dtype)
    if parts is not None:
        y = tuple(jnp.split(y, list(itertools.accumulate(parts))[:-1], axis=-1))
    return y, _new_state(x, state, seq_idx, state_seq_idx)


def _new_state(x, state, seq_idx, state_seq_idx):
    """The window after x: its last k - 1 inputs (with the state's where x is shorter), zeroed
    where they belong to an earlier document than the row's last."""
    l, k1 = x.shape[1], state.shape[1]
    if l >= k1:
        new_state = x[:, l - k1 :]
    else:
        new_state = jnp.concatenate([state.astype(x.dtype)[:, l:], x], axis=1)
    if seq_idx is not None:  # the next token continues the last document only
        seq_p = jnp.concatenate([state_seq_idx, seq_idx], axis=1)
        keep = seq_p[:, seq_p.shape[1] - k1 :] == seq_idx[:, -1:]
        new_state = jnp.where(keep[..., None], new_state, 0)
    return new_state.astype(x.dtype)
