"""Mamba-2 SSD by the chunked (state-passing) algorithm, pure JAX on any backend.

Dao & Gu, "Transformers are SSMs" (arXiv:2405.21060) §6 / Listing 1: split l into chunks,
take the quadratic form inside each chunk and a linear recurrence over chunk states between
them. The recurrence over chunks is a lax.scan, so the cost is linear in l (the paper's
(c+1) x (c+1) matmul form is quadratic in the number of chunks).

Letters: b batch, c chunk, s / t target / source position in a chunk, g group, r head within
its group (head = g * (h // g) + r), p head dim, n state dim.
"""

import functools

import jax
import jax.numpy as jnp

from .reference import compute_dtype, run_ids, segsum


@functools.partial(jax.jit, static_argnames=("chunk_size", "return_final_state"))
def ssd_chunked(
    x,
    dt,
    A,
    B,
    C,
    *,
    chunk_size,
    D=None,
    initial_state=None,
    return_final_state=False,
    seq_idx=None,
):
    """SSD in O(l * chunk_size); same contract as `ssd_reference` (see ops.ssd for shapes).

    seq_idx is applied exactly by masking: pairs across a document change are masked in the
    intra-chunk segsum, chunk states only count positions of the chunk-end document, the
    carried state is zeroed when the document changes, and the incoming state only reaches
    positions of its own document. Padding (dt = 0, zero inputs, seq_idx repeating the last
    value) decays by exp(0) = 1 and adds nothing, so outputs and final state are unchanged.
    """
    dtype = compute_dtype(x, dt, A, B, C, D, initial_state)
    b, l, h, p = x.shape
    g, n = B.shape[2:]
    r = h // g
    k = chunk_size
    c = -(-l // k)
    pad = c * k - l
    seq_bl = jnp.zeros((b, l), jnp.int32) if seq_idx is None else run_ids(seq_idx)

    def chunked(v, *tail):
        """Zero-pad the sequence axis and split it into (c, k), then split heads if asked."""
        v = jnp.pad(v.astype(dtype), [(0, 0), (0, pad)] + [(0, 0)] * (v.ndim - 2))
        return v.reshape(b, c, k, *tail)

    x_bcsgrp = chunked(x, g, r, p)
    dt_bcsgr = chunked(dt, g, r)
    B_bcsgn, C_bcsgn = chunked(B, g, n), chunked(C, g, n)
    seq_bcs = jnp.pad(seq_bl, [(0, 0), (0, pad)], mode="edge").reshape(b, c, k)
    xdt_bcsgrp = x_bcsgrp * dt_bcsgr[..., None]
    a_bcgrs = jnp.einsum("bcsgr,gr->bcgrs", dt_bcsgr, A.astype(dtype).reshape(g, r))
    lam_bcgrs = jnp.cumsum(a_bcgrs, axis=-1)  # log-decay from chunk start through s

    # 1) Intra-chunk (diagonal blocks): masked quadratic form within each chunk.
    same_bcst = seq_bcs[:, :, :, None] == seq_bcs[:, :, None, :]
    L_bcgrst = jnp.exp(segsum(a_bcgrs, same_bcst[:, :, None, None]))
    CB_bcgst = jnp.einsum("bcsgn,bctgn->bcgst", C_bcsgn, B_bcsgn)
    scores_bcgrst = CB_bcgst[:, :, :, None] * L_bcgrst
    y_bcsgrp = jnp.einsum("bcgrst,bctgrp->bcsgrp", scores_bcgrst, xdt_bcsgrp)

    # 2) Chunk states: each chunk's contribution to the state at its end. The last row of the
    # masked L already drops positions outside the chunk-end document.
    states_bcgrpn = jnp.einsum(
        "bcgrt,bctgrp,bctgn->bcgrpn", L_bcgrst[..., -1, :], xdt_bcsgrp, B_bcsgn
    )

    # 3) Inter-chunk state passing. doc_in[c] is the document of the state entering chunk c
    # (the initial state belongs to the row's first document); the carry survives a chunk
    # only if that chunk ends in the same document.
    doc_in_bc = jnp.concatenate([seq_bcs[:, :1, 0], seq_bcs[:, :-1, -1]], axis=1)
    keep_bc = seq_bcs[:, :, -1] == doc_in_bc
    chunk_decay_bcgr = jnp.exp(jnp.where(keep_bc[:, :, None, None], lam_bcgrs[..., -1], -jnp.inf))
    if initial_state is None:
        h0_bgrpn = jnp.zeros((b, g, r, p, n), dtype)
    else:
        h0_bgrpn = initial_state.astype(dtype).reshape(b, g, r, p, n)

    def pass_state(h_bgrpn, inputs):
        """Carry the state over one chunk; emit the state entering it."""
        decay_bgr, state_bgrpn = inputs
        return decay_bgr[..., None, None] * h_bgrpn + state_bgrpn, h_bgrpn

    final_bgrpn, h_in_cbgrpn = jax.lax.scan(
        pass_state,
        h0_bgrpn,
        (jnp.moveaxis(chunk_decay_bcgr, 1, 0), jnp.moveaxis(states_bcgrpn, 1, 0)),
    )
    h_in_bcgrpn = jnp.moveaxis(h_in_cbgrpn, 0, 1)

    # 4) State -> output: the incoming state, decayed to each position of its own document.
    own_doc_bcs = seq_bcs == doc_in_bc[:, :, None]
    out_decay_bcgrs = jnp.exp(jnp.where(own_doc_bcs[:, :, None, None], lam_bcgrs, -jnp.inf))
    y_bcsgrp += jnp.einsum("bcsgn,bcgrpn,bcgrs->bcsgrp", C_bcsgn, h_in_bcgrpn, out_decay_bcgrs)

    y_blhp = y_bcsgrp.reshape(b, c * k, h, p)[:, :l]
    if D is not None:
        y_blhp += D.astype(dtype)[:, None] * x.astype(dtype)
    y_blhp = y_blhp.astype(x.dtype)
    if not return_final_state:
        return y_blhp
    return y_blhp, final_bgrpn.reshape(b, h, p, n)
