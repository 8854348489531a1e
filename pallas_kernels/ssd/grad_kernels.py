"""The SSD's backward kernels (see kernel.py's docstring for the algorithm): per source tile t the
dx of one head (grad_dx) and the dB / decay terms of a block of heads (grad_db); per target tile s
the dC / decay terms of a block of heads (grad_target). Letters as in kernel.py."""

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
    dy_ref, b_ref, cbt_ref, cs_c_ref, cs_r_ref, dt_c_ref, seq_c_ref, seq_r_ref, wst_ref, dh_ref,
    d_ref, dx_ref, *, tile, seq_major,
):  # fmt: skip
    """dx for source tile i (rows t) of one head: the targets s >= t of the chunk through
    C_s.B_t L[s, t], the outgoing state's gradient through B_t, and D dy_t."""
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
    dx_tp += d_ref[0, 0] * dy_h[rows_t, :].astype(F32)
    head(dx_ref, 0, seq_major)[...] = dx_tp.astype(dx_ref.dtype)  # the block is this tile


def grad_db_kernel(
    x_ref, dy_ref, b_ref, c_ref, cbt_ref, cs_c_ref, cs_r_ref, dt_c_ref, seq_c_ref, seq_r_ref,
    wst_ref, dh_ref, db_ref, ddt_ref, v_ref, *, tile, seq_major,
):  # fmt: skip
    """For source tile i (rows t) and a block of heads of one group, over targets s >= t in
    [t, s] orientation: dB summed over the block's heads, per head ddt's intra part
    sum_s G.L.CB and v_t = x_t . (dH_out B_t), with G = x_t . dy_s. Heads are the inner loop:
    their dt G L tiles are summed before the one matmul with C_s per target tile."""
    i = pl.program_id(3)
    k, heads = b_ref.shape[0], cs_c_ref.shape[0]
    rows_t = pl.ds(pl.multiple_of(i * tile, tile), tile)
    b_t, seq_t = b_ref[rows_t, :], seq_c_ref[rows_t, :]
    pos_t = positions(i * tile, tile, as_row=False)

    def over_targets(j, carry):
        db_tn, ddt_th = carry
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
            ddt_th = _add_to_column(ddt_th, hh, jnp.sum(gl_ts * cb_ts, axis=1, keepdims=True))
            return w_ts + gl_ts * Head(dt_c_ref, hh)[rows_t, :], ddt_th

        w_ts, ddt_th = jax.lax.fori_loop(
            0, heads, over_heads, (jnp.zeros((tile, tile), F32), ddt_th)
        )
        return db_tn + dot(w_ts.astype(c_ref.dtype), c_ref[cols, :]), ddt_th

    n = b_t.shape[1]
    init = (jnp.zeros((tile, n), F32), jnp.zeros((tile, heads), F32))
    db_tn, ddt_th = jax.lax.fori_loop(i, k // tile, over_targets, init)

    def state_terms(hh, db_tn):
        x_t = head(x_ref, hh, seq_major)[rows_t, :]
        x_dh_tn = dot(x_t, Head(dh_ref, hh)[...].astype(x_t.dtype))
        Head(v_ref, hh)[...] = jnp.sum(x_dh_tn * b_t.astype(F32), axis=1, keepdims=True)
        Head(ddt_ref, hh)[...] = _column_of(ddt_th, hh)
        w_t = Head(dt_c_ref, hh)[rows_t, :] * Head(wst_ref, hh)[rows_t, :]
        return db_tn + w_t * x_dh_tn

    db_ref[...] = jax.lax.fori_loop(0, heads, state_terms, db_tn)


def grad_target_kernel(
    x_ref, dy_ref, b_ref, c_ref, cb_ref, cs_c_ref, cs_r_ref, dt_r_ref, seq_c_ref, seq_r_ref,
    wout_ref, h_ref, dc_ref, rowsum_ref, u_ref, *, tile, seq_major,
):  # fmt: skip
    """For target tile i (rows s) and a block of heads of one group, over sources t <= s in
    [s, t] orientation: dC summed over the block's heads, per head rowsum_t(G.L.CB.dt) and
    u_s = dy_s . (H_in C_s). Heads are the inner loop, as in the dB kernel."""
    i = pl.program_id(3)
    heads = cs_c_ref.shape[0]
    rows_s = pl.ds(pl.multiple_of(i * tile, tile), tile)
    c_s, seq_s = c_ref[rows_s, :], seq_c_ref[rows_s, :]
    pos_s = positions(i * tile, tile, as_row=False)

    def over_sources(j, carry):
        dc_sn, rowsum_sh = carry
        start = pl.multiple_of(j * tile, tile)
        cols = pl.ds(start, tile)
        keep = causal_keep(seq_s, seq_r_ref[:, cols], pos_s, positions(start, tile, True))
        cb_st = cb_ref[rows_s, cols]

        def over_heads(hh, inner):
            w_st, rowsum_sh = inner
            dy_s = head(dy_ref, hh, seq_major)[rows_s, :]
            x_t = head(x_ref, hh, seq_major)[cols, :]
            decay_st = masked_exp(keep, Head(cs_c_ref, hh)[rows_s, :] - Head(cs_r_ref, hh)[:, cols])
            q_st = dot(dy_s, x_t, trans_b=True) * decay_st * Head(dt_r_ref, hh)[:, cols]
            rowsum_sh = _add_to_column(rowsum_sh, hh, jnp.sum(q_st * cb_st, axis=1, keepdims=True))
            return w_st + q_st, rowsum_sh

        w_st, rowsum_sh = jax.lax.fori_loop(
            0, heads, over_heads, (jnp.zeros((tile, tile), F32), rowsum_sh)
        )
        return dc_sn + dot(w_st.astype(b_ref.dtype), b_ref[cols, :]), rowsum_sh

    init = (jnp.zeros((tile, c_s.shape[1]), F32), jnp.zeros((tile, heads), F32))
    dc_sn, rowsum_sh = jax.lax.fori_loop(0, i + 1, over_sources, init)

    def state_terms(hh, dc_sn):
        dy_s = head(dy_ref, hh, seq_major)[rows_s, :]
        dy_h_sn = dot(dy_s, Head(h_ref, hh)[...].astype(dy_s.dtype))
        Head(rowsum_ref, hh)[...] = _column_of(rowsum_sh, hh)
        Head(u_ref, hh)[...] = jnp.sum(dy_h_sn * c_s.astype(F32), axis=1, keepdims=True)
        return dc_sn + Head(wout_ref, hh)[rows_s, :] * dy_h_sn

    dc_ref[...] = jax.lax.fori_loop(0, heads, state_terms, dc_sn)
