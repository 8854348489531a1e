"""Mamba-2 SSD in Pallas: the chunked algorithm as five kernels plus small scans and matmuls.

Forward (Dao & Gu, arXiv:2405.21060 §6): with cs the within-chunk cumulative log-decay,
    chunk_state:  S_c = sum_t w_state[t] dt[t] x_t B_t^T                       (p, n) per chunk
    pass:         H_in[c+1] = decay_c H_in[c] + S_c                            state passing
    chunk_out:    y_s = sum_{t<=s} (C_s.B_t) L[s,t] dt_t x_t + w_out[s] H_in C_s + D x_s
with L[s,t] = exp(cs_s - cs_t), w_out[s] = exp(cs_s), w_state[t] = exp(cs_K - cs_t) and
decay_c = exp(cs_K), each zeroed where seq_idx says the positions belong to different
documents. Backward: chunk_state again (on dy, C, w_out) for the state gradient, a reverse scan
of it, then per source tile t grad_dx (one head) and grad_bc (dB, dC and the decay terms of a
block of heads). grad_bc loops over heads inside the loop over target tiles s: per head the
one product x_t . dy_s serves dB, dC and both decay row sums, and the heads' dt G L matrices are
summed before the two matmuls with C_s and B_t; dC and the target-side row sums leave it as
per-source-tile partials that JAX sums. The per-position decay gradient is assembled in JAX from
the kernels' row sums; ddt is never obtained by dividing by dt.

C_s . B_t of every pair in a chunk is one batched matmul in XLA, shared by the heads of a
group and stored in the matmul dtype (the kernels round C.B L to it before their matmuls
anyway; bf16 halves the largest load); the kernels read its (tile, tile) blocks. Kernels see
one chunk and a block of heads at a time, tiled by `tile` rows; nothing of size
(b, l, h, p, n) is written. Variants: "gpu" keeps the (b, l, h, p) layout of the caller
(strided blocks are free for Triton) and passes states over chunks with a small kernel; "tpu"
moves heads in front so every block ends in two whole-or-tiled dims, and passes states with a
lax.scan (both in state_passing.py). On Hopper, chunk_state and chunk_out are the Mosaic GPU
kernels of kernel_mgpu.py (wgmma, TMA; measured faster) when the inputs suit them and XLA keeps
custom calls out of its CUDA graphs, else the Triton ones here. The inputs are padded and laid
out, and the kernels chained, by pallas.py; block specs: tiling.py. Letters:
b batch, h head, g group, c chunk, k chunk length, s / t target / source position, p head dim,
n state dim.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ..backend import compiler_params, interpret_for

F32 = jnp.float32

# ---------------------------------------------------------------- tile pieces
# Shared by the forward and backward kernels: fp32-accumulating matmuls, the causal /
# same-document mask, masked decays, position vectors, and a view of one head of a block of heads.


def dot(a, b, *, trans_a=False, trans_b=False):
    """a @ b with optional transposes, fp32 accumulation."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=F32)


def causal_keep(seq_a, seq_b, pos_a, pos_b):
    """Pairs (a, b) with b <= a in the same document: where L is nonzero."""
    return (pos_b <= pos_a) & (seq_a == seq_b)


def masked_exp(keep, log_value):
    """exp(log_value) where keep else 0; exp never sees the masked (possibly huge) values."""
    return jnp.where(keep, jnp.exp(jnp.where(keep, log_value, 0.0)), 0.0)


def positions(start, n, as_row):
    """Chunk positions start..start+n-1 as an (n, 1) column or a (1, n) row."""
    shape = (1, n) if as_row else (n, 1)
    return start + jax.lax.broadcasted_iota(jnp.int32, shape, 1 if as_row else 0)


class Head:
    """Head hh of a ref that holds a block of heads on `axis`, indexed like a ref of one head.
    (Triton lowers one indexer per load or store: `ref.at[hh][rows]` views cannot be used.)"""

    def __init__(self, ref, hh, axis=0):
        self.ref, self.hh, self.axis = ref, hh, axis
        self.dtype = ref.dtype
        self.shape = tuple(d for a, d in enumerate(ref.shape) if a != axis)

    def _index(self, idx):
        idx = [] if idx is Ellipsis else list(idx if isinstance(idx, tuple) else (idx,))
        idx += [slice(None)] * (len(self.shape) - len(idx))
        idx.insert(self.axis, self.hh)
        return tuple(idx)

    def __getitem__(self, idx):
        return self.ref[self._index(idx)]

    def __setitem__(self, idx, value):
        self.ref[self._index(idx)] = value


def head(ref, hh, seq_major):
    """Head hh of an x-like block: (k, heads, f) when seq_major (gpu), else (heads, k, f)."""
    return Head(ref, hh, 1 if seq_major else 0)


# ---------------------------------------------------------------- forward kernels


def _chunk_state_kernel(x_ref, w_ref, b_ref, out_ref, *, tile, seq_major):
    """out (p, n) = sum_t w[t] x[t]^T b[t] over the chunk (fp32), one head."""
    x_ref, w_ref, out_ref = head(x_ref, 0, seq_major), Head(w_ref, 0), Head(out_ref, 0)
    k, p = x_ref.shape
    n = b_ref.shape[-1]

    def body(j, acc_pn):
        rows = pl.ds(pl.multiple_of(j * tile, tile), tile)
        xw = (x_ref[rows, :].astype(F32) * w_ref[rows, :]).astype(x_ref.dtype)
        return acc_pn + dot(xw, b_ref[rows, :], trans_a=True)

    out_ref[...] = jax.lax.fori_loop(0, k // tile, body, jnp.zeros((p, n), F32))


def _chunk_out_kernel(
    x_ref,
    cb_ref,
    c_ref,
    cs_c_ref,
    cs_r_ref,
    dt_r_ref,
    seq_c_ref,
    seq_r_ref,
    wout_ref,
    h_ref,
    d_ref,
    y_ref,
    *,
    tile,
    seq_major,
):
    """y for target tile i of one head: the causal intra-chunk sum, the incoming state, D x."""
    x_ref, y_ref = head(x_ref, 0, seq_major), head(y_ref, 0, seq_major)
    cs_c_ref, cs_r_ref, dt_r_ref, wout_ref, h_ref, d_ref = (
        Head(ref, 0) for ref in (cs_c_ref, cs_r_ref, dt_r_ref, wout_ref, h_ref, d_ref)
    )
    i = pl.program_id(3)
    rows_s = pl.ds(pl.multiple_of(i * tile, tile), tile)
    c_s = c_ref[rows_s, :]
    cs_s, seq_s = cs_c_ref[rows_s, :], seq_c_ref[rows_s, :]
    pos_s = positions(i * tile, tile, as_row=False)

    def body(j, acc_sp):
        start = pl.multiple_of(j * tile, tile)
        cols = pl.ds(start, tile)
        keep = causal_keep(seq_s, seq_r_ref[:, cols], pos_s, positions(start, tile, True))
        decay_st = masked_exp(keep, cs_s - cs_r_ref[:, cols])
        scores_st = cb_ref[rows_s, cols] * decay_st * dt_r_ref[:, cols]
        return acc_sp + dot(scores_st.astype(x_ref.dtype), x_ref[cols, :])

    acc_sp = jax.lax.fori_loop(0, i + 1, body, jnp.zeros((tile, x_ref.shape[1]), F32))
    state_sp = dot(c_s, h_ref[...].astype(c_s.dtype), trans_b=True)
    acc_sp += wout_ref[rows_s, :] * state_sp + d_ref[0, 0] * x_ref[rows_s, :].astype(F32)
    y_ref[...] = acc_sp.astype(y_ref.dtype)


# ---------------------------------------------------------------- backward kernels
# Per source tile t the dx of one head (grad_dx), and the dB, dC and decay terms of a block of
# heads (grad_bc).


def _add_to_column(mat, hh, col):
    """mat (rows, heads) with the (rows, 1) column col added to its column hh."""
    here = jax.lax.broadcasted_iota(jnp.int32, mat.shape, 1) == hh
    return mat + jnp.where(here, col, 0.0)


def _column_of(mat, hh):
    """Column hh of mat (rows, heads) as (rows, 1)."""
    here = jax.lax.broadcasted_iota(jnp.int32, mat.shape, 1) == hh
    return jnp.sum(jnp.where(here, mat, 0.0), axis=1, keepdims=True)


def grad_dx_kernel(
    dy_ref,
    x_ref,
    b_ref,
    cbt_ref,
    cs_c_ref,
    cs_r_ref,
    dt_c_ref,
    seq_c_ref,
    seq_r_ref,
    wst_ref,
    dh_ref,
    d_ref,
    dx_ref,
    dd_ref,
    *,
    tile,
    seq_major,
):
    """dx for source tile i (rows t) of one head: the targets s >= t of the chunk through
    C_s.B_t L[s, t], the outgoing state's gradient through B_t, and D dy_t; and the tile's part
    of dD, sum dy_t . x_t (1, 1)."""
    dy_h = head(dy_ref, 0, seq_major)
    cs_c_ref, cs_r_ref, dt_c_ref, wst_ref, dh_ref, d_ref = (
        Head(ref, 0) for ref in (cs_c_ref, cs_r_ref, dt_c_ref, wst_ref, dh_ref, d_ref)
    )
    i = pl.program_id(3)
    k, p = dy_h.shape
    rows_t = pl.ds(pl.multiple_of(i * tile, tile), tile)
    cs_t, seq_t = cs_c_ref[rows_t, :], seq_c_ref[rows_t, :]
    pos_t = positions(i * tile, tile, as_row=False)

    def body(j, dx_tp):
        start = pl.multiple_of(j * tile, tile)
        cols = pl.ds(start, tile)
        keep = causal_keep(seq_r_ref[:, cols], seq_t, positions(start, tile, True), pos_t)
        m_ts = cbt_ref[rows_t, cols] * masked_exp(keep, cs_r_ref[:, cols] - cs_t)
        return dx_tp + dot(m_ts.astype(dy_h.dtype), dy_h[cols, :])

    dx_tp = jax.lax.fori_loop(i, k // tile, body, jnp.zeros((tile, p), F32))
    b_t = b_ref[rows_t, :]
    b_dh_tp = dot(b_t, dh_ref[...].astype(b_t.dtype), trans_b=True)
    dx_tp = dt_c_ref[rows_t, :] * (dx_tp + wst_ref[rows_t, :] * b_dh_tp)
    dy_tp = dy_h[rows_t, :].astype(F32)
    dx_tp += d_ref[0, 0] * dy_tp
    head(dx_ref, 0, seq_major)[...] = dx_tp.astype(dx_ref.dtype)  # the block is this tile
    x_tp = head(x_ref, 0, seq_major)[...].astype(F32)  # the block is this tile
    dd_ref[...] = jnp.sum(dy_tp * x_tp, axis=(0, 1), keepdims=True)


def grad_bc_kernel(
    x_ref,
    dy_ref,
    b_ref,
    c_ref,
    cbt_ref,
    cs_c_ref,
    cs_r_ref,
    dt_c_ref,
    seq_c_ref,
    seq_r_ref,
    wst_ref,
    dh_ref,
    wout_ref,
    h_ref,
    dcb_ref,
    ddt_ref,
    v_ref,
    db_ref,
    dc_ref,
    rowsum_part_ref,
    u_ref,
    *,
    tile,
    seq_major,
):
    """The pieces of dB and dC for source tile i (rows t) and a block of heads of one group.

    Per pair of tiles (t, s >= t) and head, G = x_t . dy_s and M = G L CB (L the masked decay)
    give ddt's intra part (sum_s M, per t) and the target side's rowsum_t(M dt_t) (per s, this
    tile's partial: rows s of rowsum_part, zero for s < t). The heads' dt_t G L are summed into
    dCB[t, s] (fp32, zero for s < t), the gradient of the scores C_s . B_t: dB_t = dCB C and
    dC_s = dCB^T B are batched matmuls in JAX (fewer live registers here than accumulating them).
    State terms: db = sum_h w_state dt_t x_t dH_out (t, n) and v_t = x_t . (dH_out B_t);
    for rows i as targets dc = sum_h w_out dy_s H_in and u_s = dy_s . (H_in C_s)."""
    i = pl.program_id(3)
    k, heads = b_ref.shape[0], cs_c_ref.shape[0]
    n = b_ref.shape[1]
    rows_t = pl.ds(pl.multiple_of(i * tile, tile), tile)
    b_t, seq_t = b_ref[rows_t, :], seq_c_ref[rows_t, :]
    pos_t = positions(i * tile, tile, as_row=False)

    def zero_targets(j, carry):
        """Targets before the source tile: no pairs."""
        cols = pl.ds(pl.multiple_of(j * tile, tile), tile)
        dcb_ref[:, cols] = jnp.zeros((tile, tile), dcb_ref.dtype)
        rowsum_part_ref[:, :, cols] = jnp.zeros((heads, 1, tile), rowsum_part_ref.dtype)
        return carry

    jax.lax.fori_loop(0, i, zero_targets, 0)

    def over_targets(j, ddt_th):
        start = pl.multiple_of(j * tile, tile)
        cols = pl.ds(start, tile)
        keep = causal_keep(seq_r_ref[:, cols], seq_t, positions(start, tile, True), pos_t)
        cb_ts = cbt_ref[rows_t, cols]

        def over_heads(hh, inner):
            w_ts, ddt_th = inner
            x_t = head(x_ref, hh, seq_major)[rows_t, :]
            dy_s = head(dy_ref, hh, seq_major)[cols, :]
            decay_ts = masked_exp(keep, Head(cs_r_ref, hh)[:, cols] - Head(cs_c_ref, hh)[rows_t, :])
            gl_ts = dot(x_t, dy_s, trans_b=True) * decay_ts
            m_ts = gl_ts * cb_ts
            dt_t = Head(dt_c_ref, hh)[rows_t, :]
            ddt_th = _add_to_column(ddt_th, hh, jnp.sum(m_ts, axis=1, keepdims=True))
            Head(rowsum_part_ref, hh)[:, cols] = jnp.sum(m_ts * dt_t, axis=0, keepdims=True)
            return w_ts + gl_ts * dt_t, ddt_th

        w_ts, ddt_th = jax.lax.fori_loop(
            0, heads, over_heads, (jnp.zeros((tile, tile), F32), ddt_th)
        )
        dcb_ref[:, cols] = w_ts
        return ddt_th

    ddt_th = jax.lax.fori_loop(i, k // tile, over_targets, jnp.zeros((tile, heads), F32))

    def source_state_terms(hh, db_tn):
        x_t = head(x_ref, hh, seq_major)[rows_t, :]
        x_dh_tn = dot(x_t, Head(dh_ref, hh)[...].astype(x_t.dtype))
        Head(v_ref, hh)[...] = jnp.sum(x_dh_tn * b_t.astype(F32), axis=1, keepdims=True)
        Head(ddt_ref, hh)[...] = _column_of(ddt_th, hh)
        w_t = Head(dt_c_ref, hh)[rows_t, :] * Head(wst_ref, hh)[rows_t, :]
        return db_tn + w_t * x_dh_tn

    db_ref[...] = jax.lax.fori_loop(0, heads, source_state_terms, jnp.zeros((tile, n), F32))

    c_s = c_ref[rows_t, :]  # rows i as targets

    def target_state_terms(hh, dc_sn):
        dy_s = head(dy_ref, hh, seq_major)[rows_t, :]
        dy_h_sn = dot(dy_s, Head(h_ref, hh)[...].astype(dy_s.dtype))
        Head(u_ref, hh)[...] = jnp.sum(dy_h_sn * c_s.astype(F32), axis=1, keepdims=True)
        return dc_sn + Head(wout_ref, hh)[rows_t, :] * dy_h_sn

    dc_ref[...] = jax.lax.fori_loop(0, heads, target_state_terms, jnp.zeros((tile, n), F32))


# ---------------------------------------------------------------- launch


def call(kernel, layout, grid, in_specs, out_specs, out_shape, *, interpret, num_warps, num_stages):
    """pallas_call with this variant's compiler parameters."""
    variant = layout.variant
    return pl.pallas_call(
        functools.partial(kernel, tile=layout.tile, seq_major=layout.gpu),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params(
            variant,
            num_warps=num_warps,
            num_stages=num_stages,
            dimension_semantics=("parallel",) * len(grid),
        ),
        interpret=interpret_for(variant, interpret),
    )


def chunk_states(prep, x, w_bhck, B, *, interpret=None):
    """S (b, c, h, p', n') fp32: per chunk sum_t w[t] x[t]^T B[t] (x-like, B-like inputs)."""
    lay = prep.layout
    b, _, h, *_ = prep.shape
    p, n = prep.p_pad, prep.n_pad
    return call(
        _chunk_state_kernel,
        lay,
        (b, h, prep.c),
        [lay.chunk(p), lay.column(), lay.group_chunk(n)],
        lay.state(p, n),
        jax.ShapeDtypeStruct((b, prep.c, h, p, n), F32),
        interpret=interpret,
        num_warps=prep.sizes.num_warps,
        num_stages=prep.sizes.num_stages,
    )(x, w_bhck[..., None], B)


def chunk_outputs(prep, h_in, *, interpret=None):
    """y (b, l', h, p') in the variant's layout from the incoming states."""
    lay = prep.layout
    b, _, h, *_ = prep.shape
    p, n = prep.p_pad, prep.n_pad
    cs_c, dt_c, wout_c, cs_r, dt_r, _ = prep.vectors(prep.cs, prep.dt, prep.w_out)
    grid = (b, h, prep.c, prep.k // lay.tile)
    in_specs = [
        lay.chunk(p),
        lay.scores(),
        lay.group_chunk(n),
        lay.column(),
        lay.row(),
        lay.row(),
        lay.seq_column(),
        lay.seq_row(),
        lay.column(),
        lay.state(p, n),
        lay.scalar(),
    ]
    return call(
        _chunk_out_kernel,
        lay,
        grid,
        in_specs,
        lay.tile_of(p),
        jax.ShapeDtypeStruct(prep.x.shape, prep.out_dtype),
        interpret=interpret,
        num_warps=prep.sizes.num_warps,
        num_stages=prep.sizes.num_stages,
    )(
        prep.x,
        prep.scores(),
        prep.C,
        cs_c,
        cs_r,
        dt_r,
        prep.seq[..., None],
        prep.seq[:, :, None],
        wout_c,
        h_in,
        prep.D[:, None, None],
    )
