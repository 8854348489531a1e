"""Sparse attention over positional components only (sw, sink, dilated and their unions), without a
gather: every component's keys are contiguous tiles of k and v, so the scores are matmuls.

- sw: queries in blocks of kc, each block against its own keys and the previous block's ((kc, 2 kc)
  tiles); query i keeps i - kc < j <= i.
- sink: every query against the first kc keys; query i keeps j <= i.
- dilated (every d-th key, j = u d + d - 1, the kc most recent): a sliding window over those
  strided keys: queries in blocks of kc d against two blocks of kc strided keys.

A key two components select is kept by the first of (sw, sink, dilated) that has it, so the softmax,
one over all components' slots, counts it once. Every mask is positional (the same for every row).
The contract of `indexed.sparse_attention_indexed`: a query with no key gives 0, fp32 compute.
Letters: b batch, c block, r query within a block, t key slot within a block's tiles, s slots,
n key dim, e value dim, u strided key index.
"""

import jax
import jax.numpy as jnp

COMPONENTS = ("sw", "sink", "dilated")
HIGHEST = jax.lax.Precision.HIGHEST


def handles(spec) -> bool:
    """Whether `local_attend` takes the pattern: positional components only."""
    return set(spec.components) <= set(COMPONENTS)


def _blocks(x, size, count):
    """(b, len, f) -> (b, count, size, f), the position axis zero-padded (or cut) to count size."""
    b, length, f = x.shape
    x = jnp.pad(x, [(0, 0), (0, max(0, count * size - length)), (0, 0)])[:, : count * size]
    return x.reshape(b, count, size, f)


def _with_previous(x_bcrf):
    """Each block's rows after the previous block's (zeros before the first): slot t of block c
    is row c size - size + t."""
    previous = jnp.pad(x_bcrf[:, :-1], [(0, 0), (1, 0), (0, 0), (0, 0)])
    return jnp.concatenate([previous, x_bcrf], axis=2)


def _tile_scores(q, keys, kc, size, count):
    """Scores (b, l, 2 kc) of blocks of `size` queries against the key rows `keys` (b, m, n)
    blocked by kc, each block of queries against key blocks c - 1 and c."""
    b, l, _ = q.shape
    k_bctn = _with_previous(_blocks(keys, kc, count))
    scores = jnp.einsum("bcrn,bctn->bcrt", _blocks(q, size, count), k_bctn, precision=HIGHEST)
    return scores.reshape(b, count * size, 2 * kc)[:, :l]


def _tile_values(weights, values, kc, size, count):
    """sum_t weights[b, i, t] values-tile[t]: the counterpart of `_tile_scores`, (b, l, e)."""
    b, l, _ = weights.shape
    v_bcte = _with_previous(_blocks(values, kc, count))
    w_bcrt = _blocks(weights, size, count)
    o_bcre = jnp.einsum("bcrt,bcte->bcre", w_bcrt, v_bcte, precision=HIGHEST)
    return o_bcre.reshape(b, count * size, -1)[:, :l]


def local_attend(q, k, v, spec):
    """Sparse attention of a positional `spec` (see `handles`): o (b, l, e) fp32 of q, k (b, l, n)
    and v (b, l, e) fp32."""
    l = q.shape[1]
    kc, comps = spec.keys_per_component, spec.components
    i_l1 = jnp.arange(l)[:, None]
    parts = []  # per component: scores (b, l, s), slot key positions (l, s) (-1: none), values

    if "sw" in comps:
        count = -(-l // kc)
        t_1t = jnp.arange(2 * kc)[None, :]
        j_lt = (i_l1 // kc) * kc - kc + t_1t  # slot t of query i's block tiles
        j_lt = jnp.where((j_lt > i_l1 - kc) & (j_lt <= i_l1) & (j_lt >= 0), j_lt, -1)
        tiles = (kc, kc, count)
        parts.append((_tile_scores(q, k, *tiles), j_lt, lambda w, t=tiles: _tile_values(w, v, *t)))
    if "sink" in comps:
        m = min(kc, l)
        j_ls = jnp.broadcast_to(jnp.arange(m)[None, :], (l, m))
        keep = j_ls <= i_l1
        if "sw" in comps:
            keep &= j_ls <= i_l1 - kc  # nearer keys are the window's
        j_ls = jnp.where(keep, j_ls, -1)
        scores = jnp.einsum("bin,bsn->bis", q, k[:, :m], precision=HIGHEST)
        parts.append(
            (
                scores,
                j_ls,
                lambda w, m=m: jnp.einsum("bis,bse->bie", w, v[:, :m], precision=HIGHEST),
            )
        )
    if "dilated" in comps:
        d = spec.dilation
        size, count = kc * d, -(-l // (kc * d))
        u_i1 = (i_l1 + 1) // d - 1  # the last strided key at or before query i
        u_lt = (i_l1 // size) * kc - kc + jnp.arange(2 * kc)[None, :]
        j_lt = u_lt * d + d - 1
        ok = (u_lt > u_i1 - kc) & (u_lt <= u_i1) & (u_lt >= 0)
        if "sw" in comps:
            ok &= j_lt <= i_l1 - kc  # the window's
        if "sink" in comps:
            ok &= j_lt >= kc  # the sinks'
        strided_k, strided_v = k[:, d - 1 :: d], v[:, d - 1 :: d]
        tiles = (kc, size, count)
        parts.append(
            (
                _tile_scores(q, strided_k, *tiles),
                jnp.where(ok, j_lt, -1),
                lambda w, t=tiles: _tile_values(w, strided_v, *t),
            )
        )
    scores_bis = jnp.concatenate([p[0] for p in parts], axis=-1)
    valid_is = jnp.concatenate([p[1] for p in parts], axis=-1) >= 0
    # As indexed.softmax_attend: invalid slots finite before exp (exact zeros, no NaN gradients).
    scores_bis = jnp.where(valid_is, scores_bis, 0.0)
    max_bi1 = jnp.max(jnp.where(valid_is, scores_bis, -jnp.inf), axis=-1, keepdims=True)
    max_bi1 = jax.lax.stop_gradient(jnp.where(jnp.isfinite(max_bi1), max_bi1, 0.0))
    weights_bis = jnp.where(valid_is, jnp.exp(scores_bis - max_bi1), 0.0)
    denom_bi1 = jnp.sum(weights_bis, axis=-1, keepdims=True)
    bounds = [0]
    for part in parts:
        bounds.append(bounds[-1] + part[1].shape[-1])
    o_bie = sum(
        part[2](weights_bis[..., lo:hi])
        for part, lo, hi in zip(parts, bounds[:-1], bounds[1:], strict=True)
    )
    return o_bie / jnp.where(denom_bi1 > 0, denom_bi1, 1.0)
