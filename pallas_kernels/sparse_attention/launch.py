"""The pallas_calls of the HAX sparse-attention kernels (kernel.py): grids, block specs, scratch,
output shapes and the variant's compiler parameters, for the lsh pass (forward; backward pairs and
dv) and the ks pass (forward; backward). Letters as in kernel.py."""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ..backend import compiler_params, interpret_for
from .kernel import ks_bwd_kernel, ks_fwd_kernel, lsh_dv_kernel, lsh_fwd_kernel, lsh_pair_kernel
from .tiling import Specs, ks_specs

F32 = jnp.float32


def _call(
    kernel, grid, in_specs, out_specs, out_shape, *, cfg, scratch=(), revisit=False, aliases=None
):
    """pallas_call with the variant's compiler parameters; revisit: the last grid axis writes
    the same output block (sequential on tpu); aliases {input index: output index}: that output
    is written into the input's buffer (blocks the kernel does not write keep the input)."""
    blocks, variant, interpret = cfg
    last = "arbitrary" if revisit else "parallel"
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases or {},
        scratch_shapes=list(scratch),
        interpret=interpret_for(variant, interpret),
        compiler_params=compiler_params(
            variant,
            num_warps=blocks.num_warps,
            num_stages=blocks.num_stages,
            dimension_semantics=("parallel",) * (len(grid) - 1) + (last,),
        ),
    )


def _shape(shape, dtype=F32):
    """An output's shape and dtype."""
    return jax.ShapeDtypeStruct(shape, dtype)


def lsh_forward(q_s, k_s, v, lo, hi, lsh, sched, *, cfg):
    """The lsh pass, walking the sorted order (q_s, k_s, lo, hi sorted; v by position):
    (o (b, Lq, e) fp32 normalised, lse (b, Lq, 1)) by query."""
    blocks, variant, _ = cfg
    (b, length, n), e = q_s.shape, v.shape[-1]
    bq, bk, be = blocks.block_q, blocks.block_k, blocks.block_e
    sp = Specs(variant)
    slots = (
        ("k", (bk, n), k_s.dtype),
        ("v", (bk, be), v.dtype),
        ("o", (bq, be), F32),
        ("lse", (bq, 1), F32),
    )
    kernel = functools.partial(
        lsh_fwd_kernel, block_k=bk, block_e=be, slots=tuple(s[0] for s in slots)
    )
    column = sp.rows(bq, 1, lambda c, j: (c, 0))
    args = (sched.block_offset, sched.block_count, sched.pair_tile, lsh.key_perm, lsh.query_perm)
    args += (q_s, lo, hi, k_s, v)
    in_specs = [sp.whole(x) for x in args[:5]] + [sp.rows(bq, n, lambda c, j: (c, 0))]
    in_specs += [column, column, sp.whole(k_s), sp.whole(v)]
    out_shape = [_shape((b, length, e)), _shape((b, length, 1))]
    grid = (b, length // bq, e // be)
    return _call(
        kernel,
        grid,
        in_specs,
        [sp.whole(x) for x in out_shape],
        out_shape,
        cfg=cfg,
        scratch=sp.scratch(slots),
    )(*args)


def lsh_backward(q_s, k_s, v, lo, hi, lse_s, delta_s, do, lsh, sched, *, cfg):
    """Gradients of the lsh pass (q_s, k_s, lo, hi, lse_s, delta_s sorted; v, dO by position),
    fp32: the pairs' dq parts (b, S, BQ, n) and dk parts (b, S, BK, n), and dv (b, Lk, e) by
    position."""
    blocks, variant, _ = cfg
    (b, _, n), e = q_s.shape, v.shape[-1]
    bq, bk, be = blocks.block_q, blocks.block_k, blocks.block_e
    sp = Specs(variant)
    column = ((bq, 1), jnp.int32), ((bq, 1), F32)
    slots = (
        ("q", (bq, n), q_s.dtype),
        ("k", (bk, n), k_s.dtype),
        ("lo", *column[0]),
        ("hi", *column[0]),
        ("lse", *column[1]),
        ("delta", *column[1]),
        ("do", (bq, be), do.dtype),
        ("v", (bk, be), v.dtype),
    )
    kernel = functools.partial(
        lsh_pair_kernel, block_q=bq, block_k=bk, block_e=be, slots=tuple(s[0] for s in slots)
    )
    orders = (lsh.key_perm, lsh.query_perm)
    args = (sched.pair_count, sched.pair_block, sched.pair_tile, *orders)
    args += (q_s, lo, hi, lse_s, delta_s, do, k_s, v)
    pairs = sched.pair_tile.shape[1]
    out_specs = [sp.slab((bq, n), lambda p: (p, 0, 0)), sp.slab((bk, n), lambda p: (p, 0, 0))]
    out_shape = [_shape((b, pairs, bq, n)), _shape((b, pairs, bk, n))]
    dq_parts, dk_parts = _call(
        kernel,
        (b, pairs),
        [sp.whole(x) for x in args],
        out_specs,
        out_shape,
        cfg=cfg,
        scratch=sp.scratch(slots),
    )(*args)

    slots = tuple(s for s in slots if s[0] in ("q", "lo", "hi", "lse", "do"))
    slots += (("dv", (bk, be), F32),)
    k_length = k_s.shape[1]
    kernel = functools.partial(
        lsh_dv_kernel, block_q=bq, block_e=be, slots=tuple(s[0] for s in slots)
    )
    args = (sched.tile_offset, sched.tile_count, sched.tile_block, *orders, k_s)
    args += (q_s, lo, hi, lse_s, do)
    in_specs = [sp.whole(x) for x in args[:5]] + [sp.rows(bk, n, lambda t, j: (t, 0))]
    in_specs += [sp.whole(x) for x in args[6:]]
    out_shape = _shape((b, k_length, e))
    dv = _call(
        kernel,
        (b, k_length // bk, e // be),
        in_specs,
        sp.whole(out_shape),
        out_shape,
        cfg=cfg,
        scratch=sp.scratch(slots),
    )(*args)
    return dq_parts, dk_parts, dv


def ks_forward(q, k, v, ks_args, init, *, out_dtype, cfg):
    """The ks pass in position order, continuing from init = (o_lsh, lse_lsh) or None:
    (o (b, Lq, e) in out_dtype, lse (b, Lq, 1)); the queries are the last Lq of the Lk keys."""
    blocks, variant, _ = cfg
    (b, length, n), e = q.shape, v.shape[-1]
    bq, be = blocks.block_q, blocks.block_e
    kcp = ks_args[0].shape[2]
    first_block = (k.shape[1] - length) // bq
    sp = Specs(variant)
    in_specs = ks_specs(sp, bq, kcp, n, be, lambda c, j: j, first_block)
    out_specs = [sp.rows(bq, be, lambda c, j: (c, j)), sp.rows(bq, 1, lambda c, j: (c, 0))]
    init = init or ()
    in_specs += out_specs[: len(init)]
    kernel = functools.partial(ks_fwd_kernel, has_init=bool(init), first_block=first_block)
    out_shape = [_shape((b, length, e), out_dtype), _shape((b, length, 1))]
    return _call(
        kernel,
        (b, length // bq, e // be),
        in_specs,
        out_specs,
        out_shape,
        cfg=cfg,
        revisit=True,
    )(q, k, v, *ks_args, *init)


def ks_backward(q, k, v, ks_args, lse, delta, do, *, cfg, dv_in=None):
    """Gradients of the ks pass: dq, dk, dv of the blocks' own keys (b, Lq, .: the last Lq of
    the keys) and the prefix parts dk (b, nblocks, kcp, n), dv (b, nblocks, kcp, e); fp32.
    With dv_in (b, Lk, e) fp32 (the lsh pass's dv) the own keys' dv is added into it in place
    and dv is (b, Lk, e): no separate (b, Lq, e) array and sum."""
    blocks, variant, _ = cfg
    (b, length, n), e = q.shape, v.shape[-1]
    bq = blocks.block_q
    kcp = ks_args[0].shape[2]
    first_block = (k.shape[1] - length) // bq
    sp = Specs(variant)
    nblocks = length // bq
    column = sp.rows(bq, 1, lambda c: (c, 0))
    own_dv = sp.rows(bq, e, lambda c: (c + first_block, 0))
    in_specs = ks_specs(sp, bq, kcp, n, e, lambda c: 0, first_block)
    in_specs += [column, column, sp.rows(bq, e, lambda c: (c, 0))]
    out_specs = [sp.rows(bq, n, lambda c: (c, 0)), sp.rows(bq, n, lambda c: (c, 0))]
    out_specs += [sp.rows(bq, e, lambda c: (c, 0)) if dv_in is None else own_dv]
    out_specs += [sp.slab((kcp, n), lambda c: (c, 0, 0)), sp.slab((kcp, e), lambda c: (c, 0, 0))]
    dv_rows = length if dv_in is None else k.shape[1]
    out_shape = [_shape((b, length, n))] * 2 + [_shape((b, dv_rows, e))]
    out_shape += [_shape((b, nblocks, kcp, n)), _shape((b, nblocks, kcp, e))]
    args = (q, k, v, *ks_args, lse, delta, do)
    aliases = None
    if dv_in is not None:
        in_specs.append(own_dv)
        aliases = {len(args): 2}
        args += (dv_in,)
    kernel = functools.partial(
        ks_bwd_kernel,
        block_e=blocks.block_e,
        unrolled=variant == "tpu",
        first_block=first_block,
        accumulate=dv_in is not None,
    )
    grid = (b, nblocks)
    return _call(kernel, grid, in_specs, out_specs, out_shape, cfg=cfg, aliases=aliases)(*args)
