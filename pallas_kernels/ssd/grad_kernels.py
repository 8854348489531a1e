"""The SSD's backward kernels (see kernel.py's docstring for the algorithm): per source tile t the
dx of one head (grad_dx), and the dB, dC and decay terms of a block of heads (grad_bc). Letters as
in kernel.py."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .tiles import F32, Head, causal_keep, dot, head, masked_exp, positions


def _add_to_column(mat, hh, col):
    """mat (rows, heads) with the (rows, 1) column col added to its column hh."""
    here = jax.lax.broadcasted_iota(jnp.int32, mat.shape, 1) == hh
    return mat + jnp.where(here, col, 0.0)


def _column_of(mat, hh):
    """Column hh of mat (rows, heads) as (rows, 1)."""
    here = jax.lax.broadcasted_iota(jnp.int32, mat.shape, 1) == hh
    return jnp.sum(jnp.where(here, mat, 0.0), axis=1, keepdims=True)


def grad_dx_kernel(
    dy_ref, x_ref, b_ref, cbt_ref, cs_c_ref, cs_r_ref, dt_c_ref, seq_c_ref, seq_r_ref, wst_ref,
    dh_ref, d_ref, dx_ref, dd_ref, *, tile, seq_major,
):  # fmt: skip
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
    x_ref, dy_ref, b_ref, c_ref, cbt_ref, cs_c_ref, cs_r_ref, dt_c_ref, seq_c_ref, seq_r_ref,
    wst_ref, dh_ref, wout_ref, h_ref, dcb_ref, ddt_ref, v_ref, db_ref, dc_ref, rowsum_part_ref,
    u_ref, *, tile, seq_major,
):  # fmt: skip
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
