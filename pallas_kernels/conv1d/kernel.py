"""Triton kernels of the depthwise causal conv (hax_jax/layers/conv.py defines it): forward y and
backward dx with the kernel's and bias's gradients summed per program, in one pass each. With the
SiLU after the conv, the forward applies it, and the backward first turns the output's gradient
into the pre-activation's by a pass like the forward's (the pre-activation recomputed from x, so
it is never stored), then runs as without it.

A program takes one batch row, a block of channels and a run of T-row chunks; tap j of a chunk is
the T rows that end k - 1 - j rows earlier, loaded from memory at that offset (Triton cannot shift
rows of a register tile). The first chunk of a row reads its earlier rows from `head` ([state | the
first T rows], made by the caller: no padded copy of x), the backward's last chunk its later
gradient rows from `tail`.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ..backend import compiler_params, interpret_for

F32 = jnp.float32
ROWS = 32  # T, rows a chunk
PROGRAMS = 2048  # programs aimed at


def geometry(b: int, l: int, c: int, align: int = 0) -> tuple[int, int, int]:
    """(channels a program, time blocks, chunks a time block); l a multiple of ROWS. The channels
    a program divide c and `align` (the first channel and the parts' widths, where x is read at an
    offset or y written in parts)."""
    align = math.gcd(c, align)
    channels = next(w for w in (128, 64, 32, 16, 8, 4, 2, 1) if align % w == 0)
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


def silu_slope(pre):
    """d silu(p) / dp at the pre-activation p (fp32)."""
    sig = jax.nn.sigmoid(pre)
    return sig * (1.0 + pre * (1.0 - sig))


def _bounds(parts, channels):
    """Each part's channel blocks [first, stop)."""
    out, first = [], 0
    for width in parts:
        out.append((first, first + width // channels))
        first += width // channels
    return out


def _store_parts(refs, bounds, block, t, value):
    """Rows t .. t + T of `value` into the part that channel block `block` falls in."""
    if len(refs) == 1:
        refs[0][pl.ds(t, ROWS), :] = value.astype(refs[0].dtype)
        return
    for ref, (first, stop) in zip(refs, bounds, strict=True):

        @pl.when((block >= first) & (block < stop))
        def _(ref=ref):
            ref[pl.ds(t, ROWS), :] = value.astype(ref.dtype)


def _load_parts(refs, bounds, block, t):
    """Rows t .. t + T of the part that channel block `block` falls in."""

    def pick(i):
        rows = lambda: refs[i][pl.ds(t, ROWS), :]  # noqa: E731
        if i == len(refs) - 1:
            return rows()
        return jax.lax.cond(block < bounds[i][1], rows, lambda: pick(i + 1))

    return pick(0)


def _sums_with(sums, k, tiles, same, g):
    """sums (k + 1 of (channels,)) plus this chunk's: sum_rows tile_j * g per tap (zeroed across
    documents where `same` gives masks), and sum_rows g (the bias's)."""
    taps = [tiles[j].astype(F32) * g for j in range(k)]
    if same is not None:
        taps = [jnp.where(same[j][:, None], taps[j], 0.0) for j in range(k)]
    return [sums[j] + jnp.sum(taps[j], axis=0) for j in range(k)] + [sums[k] + jnp.sum(g, axis=0)]


def _fwd_kernel(*refs, k, chunks, has_bias, has_seq, activation, bounds):
    x_ref, head_ref, w_ref, *refs = refs
    bias_ref = refs.pop(0) if has_bias else None
    seq_ref, head_seq_ref = (refs.pop(0), refs.pop(0)) if has_seq else (None, None)
    n_in = len(bounds) if activation == "silu_grad" else 0
    g_refs, refs = refs[:n_in], refs[n_in:]
    if activation == "silu_grad":
        (y_ref, sums_ref), y_refs = refs, None
    else:
        y_refs, sums_ref = refs, None
    w = [w_ref[j, :].astype(F32) for j in range(k)]
    bias = bias_ref[...].astype(F32) if has_bias else 0.0
    block, first = pl.program_id(1), pl.program_id(2) * chunks

    def chunk(i, sums):
        t = pl.multiple_of((first + i) * ROWS, ROWS)
        tiles, same = _windows(t, k, x_ref, head_ref, seq_ref, head_seq_ref)
        y = bias + _taps(k, same, tiles, w)
        if activation == "silu_grad":
            y = _load_parts(g_refs, bounds, block, t).astype(F32) * silu_slope(y)
            sums = _sums_with(sums, k, tiles, same, y)  # from the fp32 gradient
            y_ref[pl.ds(t, ROWS), :] = y.astype(y_ref.dtype)
            return sums
        if activation == "silu":
            y = y * jax.nn.sigmoid(y)
        _store_parts(y_refs, bounds, block, t, y)
        return sums

    sums = [jnp.zeros((w[0].shape[0],), F32)] * (k + 1) if sums_ref is not None else []
    sums = jax.lax.fori_loop(0, chunks, chunk, sums)
    for j, total in enumerate(sums):
        sums_ref[j, :] = total


def _bwd_kernel(*refs, k, chunks, length, has_seq, with_sums):
    g_ref, tail_ref, w_ref, *refs = refs
    x_ref, head_ref = (refs.pop(0), refs.pop(0)) if with_sums else (None, None)
    if has_seq:
        seq_ref, head_seq_ref, tail_seq_ref, *refs = refs
    else:
        seq_ref = head_seq_ref = tail_seq_ref = None
    dx_ref, *sums_ref = refs
    w = [w_ref[j, :].astype(F32) for j in range(k)]
    first = pl.program_id(2) * chunks

    def later(t, s):
        """Gradient rows t + s .. t + s + T (zeros past the row) and their documents."""

        def from_g():
            rows = g_ref[pl.ds(t + s, ROWS), :]
            return rows, None if seq_ref is None else seq_ref[pl.ds(t + s, ROWS)]

        def from_tail():
            rows = tail_ref[pl.ds(s, ROWS), :]
            return rows, None if seq_ref is None else tail_seq_ref[pl.ds(s, ROWS)]

        if s == 0:
            return from_g()
        return jax.lax.cond(t + ROWS == length, from_tail, from_g)

    def chunk(i, sums):
        t = pl.multiple_of((first + i) * ROWS, ROWS)
        if with_sums:
            g = g_ref[pl.ds(t, ROWS), :].astype(F32)
            sums = _sums_with(sums, k, *_windows(t, k, x_ref, head_ref, seq_ref, head_seq_ref), g)
        # x_s is tap j of output s + k - 1 - j.
        pairs = [later(t, k - 1 - j) for j in range(k)]
        back = [None if seq_ref is None else p[1] == seq_ref[pl.ds(t, ROWS)] for p in pairs]
        dx = _taps(k, None if seq_ref is None else back, [p[0] for p in pairs], w)
        dx_ref[pl.ds(t, ROWS), :] = dx.astype(dx_ref.dtype)
        return sums

    sums = [jnp.zeros((w[0].shape[0],), F32)] * (k + 1) if with_sums else []
    sums = jax.lax.fori_loop(0, chunks, chunk, sums)
    for j, total in enumerate(sums):
        sums_ref[0][j, :] = total


def _row_spec(length, channels, offset=0):
    """Rows of a batch row's `channels`-wide block, `offset` blocks along (x read in place)."""
    return pl.BlockSpec((None, length, channels), lambda b, c, t: (b, 0, c + offset))


def _part_spec(length, channels, first, stop):
    """As `_row_spec` on a part holding blocks [first, stop) of the conv's channels (programs
    outside it point at its nearest block and do not touch it)."""
    return pl.BlockSpec(
        (None, length, channels),
        lambda b, c, t: (b, 0, jnp.clip(c - first, 0, stop - first - 1)),
    )


def _seq_spec(length):
    return pl.BlockSpec((None, length), lambda b, c, t: (b, 0))


def _sums_spec(k, channels):
    return pl.BlockSpec((None, None, k + 1, channels), lambda b, c, t: (b, t, 0, c))


def forward(
    x,
    kernel,
    bias,
    head,
    seq=None,
    head_seq=None,
    *,
    activation=None,
    g=None,
    start=0,
    parts=None,
    interpret=None,
):
    """The conv over x's channels start .. start + c (c = kernel.shape[1]; x (b, l, >= start + c)
    read in place): y as a tuple of arrays (b, l, width) of `parts` (widths summing to c; default
    one part), each written apart, in x's dtype. head (b, 2T, c): [the state | those channels'
    first T rows | zeros]; head_seq the same of the documents. activation "silu": SiLU(y) (fp32,
    rounded once). "silu_grad", g a tuple as y of the gradient of SiLU(y): (g * SiLU'(y) (b, l, c)
    in g's dtype, sums as `backward`'s, taken before that rounding)."""
    if (activation == "silu_grad") != (g is not None):
        raise ValueError(f"g is given with activation='silu_grad' only; got {activation!r}")
    b, l, _ = x.shape
    k, c = kernel.shape
    parts = (c,) if parts is None else tuple(parts)
    if sum(parts) != c:
        raise ValueError(f"parts {parts} must sum to the conv's channels, {c}")
    channels, blocks, chunks = geometry(b, l, c, math.gcd(start, *parts))
    bounds = _bounds(parts, channels)
    has_bias, has_seq = bias is not None, seq is not None
    specs = [
        _row_spec(l, channels, start // channels),
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
    part_specs = [_part_spec(l, channels, *bound) for bound in bounds]
    if g is None:
        out_specs = part_specs
        out_shape = [jax.ShapeDtypeStruct((b, l, width), x.dtype) for width in parts]
    else:
        specs += part_specs
        args += list(g)
        out_specs = [_row_spec(l, channels), _sums_spec(k, channels)]
        out_shape = [
            jax.ShapeDtypeStruct((b, l, c), g[0].dtype),
            jax.ShapeDtypeStruct((b, blocks, k + 1, c), F32),
        ]
    out = pl.pallas_call(
        functools.partial(
            _fwd_kernel,
            k=k,
            chunks=chunks,
            has_bias=has_bias,
            has_seq=has_seq,
            activation=activation,
            bounds=bounds,
        ),
        grid=(b, c // channels, blocks),
        in_specs=specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret_for("gpu", interpret),
        compiler_params=compiler_params("gpu", num_warps=4, num_stages=1),
        name="causal_conv1d_fwd" if g is None else "causal_conv1d_silu_bwd",
    )(*args)
    return tuple(out)


def backward(
    g,
    tail,
    kernel,
    x=None,
    head=None,
    seq=None,
    head_seq=None,
    tail_seq=None,
    *,
    start=0,
    interpret=None,
):
    """dx (b, l, c) in g's dtype and, given x and head (as `forward`'s, x read from channel
    `start`), sums (b, time blocks, k + 1, c) fp32: per program, the kernel's k tap gradients and
    the bias's (else None). g (b, l, c) the gradient of the conv's output; tail (b, 2T, c): [g's
    last T rows | zeros]."""
    b, l, c = g.shape
    k = kernel.shape[0]
    channels, blocks, chunks = geometry(b, l, c, start)
    has_seq, with_sums = seq is not None, x is not None
    specs = [
        _row_spec(l, channels),
        _row_spec(2 * ROWS, channels),
        pl.BlockSpec((k, channels), lambda b, c, t: (0, c)),
    ]
    args = [g, tail, kernel]
    if with_sums:
        specs += [_row_spec(l, channels, start // channels), _row_spec(2 * ROWS, channels)]
        args += [x, head]
    if has_seq:
        specs += [_seq_spec(l), _seq_spec(2 * ROWS), _seq_spec(2 * ROWS)]
        args += [seq, head_seq, tail_seq]
    out_specs, out_shape = [_row_spec(l, channels)], [jax.ShapeDtypeStruct(g.shape, g.dtype)]
    if with_sums:
        out_specs.append(_sums_spec(k, channels))
        out_shape.append(jax.ShapeDtypeStruct((b, blocks, k + 1, c), F32))
    out = pl.pallas_call(
        functools.partial(
            _bwd_kernel, k=k, chunks=chunks, length=l, has_seq=has_seq, with_sums=with_sums
        ),
        grid=(b, c // channels, blocks),
        in_specs=specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret_for("gpu", interpret),
        compiler_params=compiler_params("gpu", num_warps=4, num_stages=1),
        name="causal_conv1d_bwd",
    )(*args)
    return out[0], (out[1] if with_sums else None)
