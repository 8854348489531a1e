"""Triton kernels of the gated RMSNorm: rows in sequence inside a program, a row's group in one
register tile (as mamba_ssm's layernorm_gated kernels hold a row), so the mean square, the norm
and the gate take one pass over y and z forward and one over y, z and dout backward. XLA made
them two passes each way on an H200 (28 of the 400 ms of a Mamba-2 1.3B step).

Arrays are viewed (rows, groups, group_size); a program takes `rows` consecutive rows of one group
(grid: row blocks x groups). The group is loaded as a power-of-two tile wide enough for it, the
columns past it masked, so group sizes such as 1536 need no padded copy.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..backend import compiler_params, interpret_for

F32 = jnp.float32
PROGRAMS = 2048  # row blocks aimed at (rows a program: the power of two that gives at most this)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def tiling(n_rows: int, group_size: int) -> tuple[int, int, int]:
    """(rows a program, row blocks, tile width)."""
    rows = _pow2(-(-n_rows // PROGRAMS))
    return rows, -(-n_rows // rows), _pow2(group_size)


def _warps(width: int) -> int:
    return min(8, max(1, width // 256))


def _gate(z):
    """(silu(z), sigmoid(z))."""
    sig = jax.nn.sigmoid(z)
    return z * sig, sig


def _program(w_ref, n_rows, rows, group):
    """(the tile's columns inside the group, the group's weight, this program's row count)."""
    valid = jax.lax.iota(jnp.int32, w_ref.shape[0]) < group
    w = plgpu.load(w_ref, mask=valid, other=0.0)
    return valid, w, jnp.minimum(rows, n_rows - pl.program_id(0) * rows)


def _load_pre(j, y_ref, added, valid):
    """Row j's y (fp32), plus o * gain with `added` = (o_ref, gain): the norm's input."""
    pre = plgpu.load(y_ref.at[j], mask=valid, other=0.0).astype(F32)
    if added is None:
        return pre
    o_ref, gain = added
    return pre + plgpu.load(o_ref.at[j], mask=valid, other=0.0).astype(F32) * gain


def _fwd_kernel(*refs, n_rows, rows, group, eps, has_z, has_added):
    y_ref, *refs = refs
    z_ref = refs.pop(0) if has_z else None
    o_ref, gain_ref = (refs.pop(0), refs.pop(0)) if has_added else (None, None)
    w_ref, out_ref, rstd_ref = refs
    valid, w, count = _program(w_ref, n_rows, rows, group)
    added = (o_ref, plgpu.load(gain_ref, mask=valid, other=0.0)) if has_added else None

    def row(j, carry):
        u = _load_pre(j, y_ref, added, valid)
        if has_z:
            u = u * _gate(plgpu.load(z_ref.at[j], mask=valid, other=0.0).astype(F32))[0]
        rstd = jax.lax.rsqrt(jnp.sum(u * u) / group + eps)
        plgpu.store(out_ref.at[j], (u * rstd * w).astype(out_ref.dtype), mask=valid)
        rstd_ref[j] = rstd
        return carry

    jax.lax.fori_loop(0, count, row, 0)


def _bwd_kernel(*refs, n_rows, rows, group, has_z, has_added):
    y_ref, *refs = refs
    z_ref = refs.pop(0) if has_z else None
    o_ref, gain_ref = (refs.pop(0), refs.pop(0)) if has_added else (None, None)
    w_ref, rstd_ref, dout_ref, dy_ref, *refs = refs
    dz_ref = refs.pop(0) if has_z else None
    do_ref, dgain_ref = (refs.pop(0), refs.pop(0)) if has_added else (None, None)
    (dw_ref,) = refs
    valid, w, count = _program(w_ref, n_rows, rows, group)
    gain = plgpu.load(gain_ref, mask=valid, other=0.0) if has_added else None
    added = (o_ref, gain) if has_added else None

    def row(j, sums):
        dw, dgain = sums
        pre = _load_pre(j, y_ref, added, valid)
        dout = plgpu.load(dout_ref.at[j], mask=valid, other=0.0).astype(F32)
        rstd = rstd_ref[j]
        u = pre
        if has_z:
            z = plgpu.load(z_ref.at[j], mask=valid, other=0.0).astype(F32)
            silu, sig = _gate(z)
            u = pre * silu
        n = u * rstd
        dn = dout * w
        du = rstd * (dn - n * (jnp.sum(dn * n) / group))
        dpre = du
        if has_z:
            dpre = du * silu
            dz = du * pre * sig * (1.0 + z * (1.0 - sig))
            plgpu.store(dz_ref.at[j], dz.astype(dz_ref.dtype), mask=valid)
        plgpu.store(dy_ref.at[j], dpre.astype(dy_ref.dtype), mask=valid)
        if has_added:
            o = plgpu.load(o_ref.at[j], mask=valid, other=0.0).astype(F32)
            plgpu.store(do_ref.at[j], (dpre * gain).astype(do_ref.dtype), mask=valid)
            dgain = dgain + dpre * o
        return dw + dout * n, dgain

    zeros = jnp.zeros(w.shape, F32)
    dw, dgain = jax.lax.fori_loop(0, count, row, (zeros, zeros))
    plgpu.store(dw_ref, dw, mask=valid)
    if has_added:
        plgpu.store(dgain_ref, dgain, mask=valid)


def reads_in_place(e: int, group_size: int) -> bool:
    """Whether the kernels read a gate wider than e channels in place: its (rows, channels) tile
    of group g starts at channel g * tile width, which is g * group_size for one group or a
    power-of-two group size."""
    return e == group_size or group_size == _pow2(group_size)


def _specs(rows, width, z):
    """Block specs of (rows, groups, group_size) arrays, weight (groups, group_size), rstd
    (rows, groups), and the inputs [y, z] (z also (rows, channels): the gate is its first
    groups x group_size channels, `reads_in_place`); grid (row blocks, groups)."""
    rows_spec = pl.BlockSpec((rows, None, width), lambda i, g: (i, g, 0))
    weight = pl.BlockSpec((None, width), lambda i, g: (g, 0))
    rstd = pl.BlockSpec((rows, None), lambda i, g: (i, g))
    inputs = [rows_spec]
    if z is not None:
        inputs.append(
            rows_spec if z.ndim == 3 else pl.BlockSpec((rows, width), lambda i, g: (i, g))
        )
    return rows_spec, weight, rstd, inputs


def _added_args(added, rows_spec, weight_spec):
    """(specs, arrays) of `added` = (o as y, gain (groups, group_size)), or none."""
    if added is None:
        return [], []
    return [rows_spec, weight_spec], [added[0], added[1].astype(F32)]


def forward(y, z, weight, *, eps, added=None, interpret=None):
    """y, z (rows, groups, group_size) (z also (rows, >= groups x group_size), `reads_in_place`),
    weight (groups, group_size) -> (out as y, rstd (rows, groups) fp32). added: (o as y, gain
    (groups, group_size)); the norm's input is then y + o * gain."""
    n_rows, groups, group = y.shape
    rows, blocks, width = tiling(n_rows, group)
    has_z, has_added = z is not None, added is not None
    rows_spec, weight_spec, rstd_spec, inputs = _specs(rows, width, z)
    added_specs, added_arrays = _added_args(added, rows_spec, weight_spec)
    kernel = functools.partial(
        _fwd_kernel,
        n_rows=n_rows,
        rows=rows,
        group=group,
        eps=eps,
        has_z=has_z,
        has_added=has_added,
    )
    return pl.pallas_call(
        kernel,
        grid=(blocks, groups),
        in_specs=[*inputs, *added_specs, weight_spec],
        out_specs=[rows_spec, rstd_spec],
        out_shape=[
            jax.ShapeDtypeStruct(y.shape, y.dtype),
            jax.ShapeDtypeStruct((n_rows, groups), F32),
        ],
        interpret=interpret_for("gpu", interpret),
        compiler_params=compiler_params("gpu", num_warps=_warps(width), num_stages=1),
        name="gated_norm_fwd",
    )(*(a for a in (y, z) if a is not None), *added_arrays, weight.astype(F32))


def backward(y, z, weight, rstd, dout, *, added=None, interpret=None):
    """-> (dy as y, dz as y or None, dweight partials (row blocks, groups, group_size) fp32, and
    with `added` (as `forward`'s) (do as o, dgain partials as dweight's), else None)."""
    n_rows, groups, group = y.shape
    rows, blocks, width = tiling(n_rows, group)
    has_z, has_added = z is not None, added is not None
    rows_spec, weight_spec, rstd_spec, inputs = _specs(rows, width, z)
    added_specs, added_arrays = _added_args(added, rows_spec, weight_spec)
    kernel = functools.partial(
        _bwd_kernel, n_rows=n_rows, rows=rows, group=group, has_z=has_z, has_added=has_added
    )
    partials_shape = jax.ShapeDtypeStruct((blocks, groups, group), F32)
    partials_spec = pl.BlockSpec((None, None, width), lambda i, g: (i, g, 0))
    out_shape = [jax.ShapeDtypeStruct(y.shape, y.dtype)]
    out_specs = [rows_spec]
    if has_z:
        out_shape.append(jax.ShapeDtypeStruct(y.shape, z.dtype))
        out_specs.append(rows_spec)
    if has_added:
        out_shape += [jax.ShapeDtypeStruct(added[0].shape, added[0].dtype), partials_shape]
        out_specs += [rows_spec, partials_spec]
    out_shape.append(partials_shape)
    out_specs.append(partials_spec)
    outs = pl.pallas_call(
        kernel,
        grid=(blocks, groups),
        in_specs=[*inputs, *added_specs, weight_spec, rstd_spec, rows_spec],
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret_for("gpu", interpret),
        compiler_params=compiler_params("gpu", num_warps=_warps(width), num_stages=1),
        name="gated_norm_bwd",
    )(*(a for a in (y, z) if a is not None), *added_arrays, weight.astype(F32), rstd, dout)
    dy, *rest = outs
    dz = rest.pop(0) if has_z else None
    d_added = (rest.pop(0), rest.pop(0)) if has_added else None
    return dy, dz, rest[0], d_added
