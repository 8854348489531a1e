"""Triton kernels of the depthwise causal conv (hax_jax/layers/conv.py defines it): forward y and
backward dx with the kernel's and bias's gradients summed per program, in one pass each.

A program takes one batch row, a block of channels and a run of T-row chunks; tap j of a chunk is
the T rows that end k - 1 - j rows earlier, loaded from memory at that offset (Triton cannot shift
rows of a register tile). The first chunk of a row reads its earlier rows from `head` ([state | the
first T rows], made by the caller: no padded copy of x), the backward's last chunk its later
gradient rows from `tail`.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ..backend import compiler_params, interpret_for

F32 = jnp.float32
ROWS = 32  # T, rows a chunk
PROGRAMS = 2048  # programs aimed at
# Channels a program of the backward with the SiLU, which holds about twice the forward's tiles.
SILU_BACKWARD_CHANNELS = 32


def geometry(b: int, l: int, c: int, widest: int = 128) -> tuple[int, int, int]:
    """(channels a program, at most `widest`; time blocks, chunks a time block); l a multiple of
    ROWS."""
    channels = next(w for w in (128, 64, 32, 16, 8, 4, 2, 1) if w <= widest and c % w == 0)
    chunks = l // ROWS
    blocks = 1
    while blocks * 2 <= chunks and chunks % (blocks * 2) == 0:
        if b * (c // channels) * blocks >= PROGRAMS:
            break
        blocks *= 2
    return channels, blocks, chunks // blocks


def _taps(k, same, tiles, w):
    """sum_j w_j tile_j (fp32), tap j zeroed across documents where `same` gives masks."""
    out = 0.0
    for j in range(k):
        tile = tiles[j].astype(F32) * w[j]
        out = out + (tile if same is None else jnp.where(same[j][:, None], tile, 0.0))
    return out


def _earlier(t, s, x_ref, head_ref, seq_ref, head_seq_ref, k):
    """Rows t - s .. t - s + T of [state | x] and their documents (None without seq_idx)."""

    def from_x():
        rows = x_ref[pl.ds(t - s, ROWS), :]
        return rows, None if seq_ref is None else seq_ref[pl.ds(t - s, ROWS)]

    def from_head():
        rows = head_ref[pl.ds(k - 1 - s, ROWS), :]
        return rows, None if seq_ref is None else head_seq_ref[pl.ds(k - 1 - s, ROWS)]

    if s == 0:
        return from_x()
    return jax.lax.cond(t == 0, from_head, from_x)


def _windows(t, k, x_ref, head_ref, seq_ref, head_seq_ref):
    """The k taps' rows of chunk t and, with seq_idx, whether each reads the row's document."""
    pairs = [_earlier(t, k - 1 - j, x_ref, head_ref, seq_ref, head_seq_ref, k) for j in range(k)]
    tiles = [p[0] for p in pairs]
    if seq_ref is None:
        return tiles, None
    own = seq_ref[pl.ds(t, ROWS)]
    return tiles, [p[1] == own for p in pairs]


def _fwd_kernel(*refs, k, chunks, has_bias, has_seq, silu):
    x_ref, head_ref, w_ref, *refs = refs
    bias_ref = refs.pop(0) if has_bias else None
    seq_ref, head_seq_ref = (refs.pop(0), refs.pop(0)) if has_seq else (None, None)
    (y_ref,) = refs
    w = [w_ref[j, :].astype(F32) for j in range(k)]
    bias = bias_ref[...].astype(F32) if has_bias else 0.0
    first = pl.program_id(2) * chunks

    def chunk(i, carry):
        t = pl.multiple_of((first + i) * ROWS, ROWS)
        tiles, same = _windows(t, k, x_ref, head_ref, seq_ref, head_seq_ref)
        y = bias + _taps(k, same, tiles, w)
        if silu:
            y = y * jax.nn.sigmoid(y)
        y_ref[pl.ds(t, ROWS), :] = y.astype(y_ref.dtype)
        return carry

    jax.lax.fori_loop(0, chunks, chunk, 0)


def silu_slope(pre):
    """d silu(p) / dp at the pre-activation p (fp32)."""
    sig = jax.nn.sigmoid(pre)
    return sig * (1.0 + pre * (1.0 - sig))


def _bwd_kernel(*refs, k, chunks, length, has_bias, has_seq, silu):
    g_ref, g_tail_ref, x_ref, head_ref, w_ref, *refs = refs
    x_tail_ref = refs.pop(0) if silu else None
    bias_ref = refs.pop(0) if silu and has_bias else None
    if has_seq:
        seq_ref, head_seq_ref, tail_seq_ref, *refs = refs
    else:
        seq_ref = head_seq_ref = tail_seq_ref = None
    dx_ref, sums_ref = refs
    w = [w_ref[j, :].astype(F32) for j in range(k)]
    bias = bias_ref[...].astype(F32) if bias_ref is not None else 0.0
    first = pl.program_id(2) * chunks

    def later(t, s, ref, tail_ref):
        """Rows t + s .. t + s + T of `ref` (past the row: of `tail_ref`) and their documents."""

        def from_ref():
            rows = ref[pl.ds(t + s, ROWS), :]
            return rows, None if seq_ref is None else seq_ref[pl.ds(t + s, ROWS)]

        def from_tail():
            rows = tail_ref[pl.ds(s, ROWS), :]
            return rows, None if seq_ref is None else tail_seq_ref[pl.ds(s, ROWS)]

        if s == 0:
            return from_ref()
        return jax.lax.cond(t + ROWS == length, from_tail, from_ref)

    def same_document(pairs, own):
        return None if seq_ref is None else [p[1] == own for p in pairs]

    def chunk(i, sums):
        t = pl.multiple_of((first + i) * ROWS, ROWS)
        own = None if seq_ref is None else seq_ref[pl.ds(t, ROWS)]
        x_rows = {}  # x's rows at an offset from the chunk, loaded at their first use

        def x_at(o):
            if o not in x_rows:
                x_rows[o] = (
                    _earlier(t, -o, x_ref, head_ref, seq_ref, head_seq_ref, k)
                    if o <= 0
                    else later(t, o, x_ref, x_tail_ref)
                )
            return x_rows[o]

        # Rows t + s, s = 0 .. k - 1, one at a time (few tiles live): their gradient before the
        # SiLU (its pre-activation recomputed from x, not stored) reaches x_t.. through tap
        # k - 1 - s; rows t's gives the kernel's and bias's.
        dx = 0.0
        for s in range(k):
            g_rows, g_docs = later(t, s, g_ref, g_tail_ref)
            g = g_rows.astype(F32)
            if silu:
                window = [x_at(s - (k - 1) + j) for j in range(k)]
                same = same_document(window, window[-1][1])
                g = g * silu_slope(bias + _taps(k, same, [p[0] for p in window], w))
            if s == 0:
                window = [x_at(j - (k - 1)) for j in range(k)]
                taps = _taps_apart(k, same_document(window, own), [p[0] for p in window], g)
                sums = [sums[j] + jnp.sum(taps[j], axis=0) for j in range(k)] + [
                    sums[k] + jnp.sum(g, axis=0)
                ]
            term = g * w[k - 1 - s]
            dx = dx + (term if seq_ref is None else jnp.where((g_docs == own)[:, None], term, 0.0))
        dx_ref[pl.ds(t, ROWS), :] = dx.astype(dx_ref.dtype)
        return sums

    width = w[0].shape[0]
    sums = jax.lax.fori_loop(0, chunks, chunk, [jnp.zeros((width,), F32)] * (k + 1))
    for j in range(k + 1):
        sums_ref[j, :] = sums[j]


def _taps_apart(k, same, tiles, g):
    """tile_j * g per tap (fp32), zeroed across documents where `same` gives masks."""
    out = [tiles[j].astype(F32) * g for j in range(k)]
    if same is None:
        return out
    return [jnp.where(same[j][:, None], out[j], 0.0) for j in range(k)]


def _row_spec(length, channels):
    return pl.BlockSpec((None, length, channels), lambda b, c, t: (b, 0, c))


def _seq_spec(length):
    return pl.BlockSpec((None, length), lambda b, c, t: (b, 0))


def forward(x, kernel, bias, head, seq=None, head_seq=None, *, silu=False, interpret=None):
    """y (b, l, c) in x's dtype (with `silu`, SiLU of it, taken in fp32). head (b, 2T, c):
    [state | x's first T rows | zeros]; head_seq the same of the documents."""
    b, l, c = x.shape
    k = kernel.shape[0]
    channels, blocks, chunks = geometry(b, l, c)
    has_bias, has_seq = bias is not None, seq is not None
    specs = [
        _row_spec(l, channels),
        _row_spec(2 * ROWS, channels),
        pl.BlockSpec((k, channels), lambda b, c, t: (0, c)),
    ]
    args = [x, head, kernel]
    if has_bias:
        specs.append(pl.BlockSpec((channels,), lambda b, c, t: (c,)))
        args.append(bias)
    if has_seq:
        specs += [_seq_spec(l), _seq_spec(2 * ROWS)]
        args += [seq, head_seq]
    return pl.pallas_call(
        functools.partial(
            _fwd_kernel, k=k, chunks=chunks, has_bias=has_bias, has_seq=has_seq, silu=silu
        ),
        grid=(b, c // channels, blocks),
        in_specs=specs,
        out_specs=_row_spec(l, channels),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        interpret=interpret_for("gpu", interpret),
        compiler_params=compiler_params("gpu", num_warps=4, num_stages=1),
        name="causal_conv1d_fwd",
    )(*args)


def backward(
    g,
    g_tail,
    x,
    kernel,
    head,
    seq=None,
    head_seq=None,
    tail_seq=None,
    *,
    silu=None,
    interpret=None,
):
    """(dx (b, l, c) in x's dtype, sums (b, time blocks, k + 1, c) fp32: per program, the kernel's
    k tap gradients and the bias's). g_tail (b, 2T, c): [g's last T rows | zeros]. silu: None, or
    (x_tail, bias) where the output was SiLU'd: x_tail as g_tail of x, bias (c,) or None; the
    pre-activations are then recomputed from x."""
    b, l, c = x.shape
    k = kernel.shape[0]
    widest = 128 if silu is None else SILU_BACKWARD_CHANNELS
    channels, blocks, chunks = geometry(b, l, c, widest)
    has_seq = seq is not None
    has_bias = silu is not None and silu[1] is not None
    specs = [
        _row_spec(l, channels),
        _row_spec(2 * ROWS, channels),
        _row_spec(l, channels),
        _row_spec(2 * ROWS, channels),
        pl.BlockSpec((k, channels), lambda b, c, t: (0, c)),
    ]
    args = [g, g_tail, x, head, kernel]
    if silu is not None:
        specs.append(_row_spec(2 * ROWS, channels))
        args.append(silu[0])
    if has_bias:
        specs.append(pl.BlockSpec((channels,), lambda b, c, t: (c,)))
        args.append(silu[1])
    if has_seq:
        specs += [_seq_spec(l), _seq_spec(2 * ROWS), _seq_spec(2 * ROWS)]
        args += [seq, head_seq, tail_seq]
    return pl.pallas_call(
        functools.partial(
            _bwd_kernel,
            k=k,
            chunks=chunks,
            length=l,
            has_bias=has_bias,
            has_seq=has_seq,
            silu=silu is not None,
        ),
        grid=(b, c // channels, blocks),
        in_specs=specs,
        out_specs=[
            _row_spec(l, channels),
            pl.BlockSpec((None, None, k + 1, channels), lambda b, c, t: (b, t, 0, c)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct(x.shape, x.dtype),
            jax.ShapeDtypeStruct((b, blocks, k + 1, c), F32),
        ],
        interpret=interpret_for("gpu", interpret),
        compiler_params=compiler_params("gpu", num_warps=4, num_stages=1),
        name="causal_conv1d_bwd",
    )(*args)
