"""HAX sparse attention in O(l * num_keys * (n + e)): gather the selected keys, never an (l, l).

Each component yields, per query, kc candidate key positions (b, l, kc) int32 plus a validity
mask: sw / sink / dilated by arithmetic, lsh by one sort of keys and queries together by
(bucket, position), ks by a blockwise running top-k. The components are concatenated to
(b, l, num_keys), duplicates are masked after a per-query sort, and the softmax runs over those
slots only, in blocks of queries under jax.checkpoint so the backward pass never holds the
gathered (b, l, num_keys, e) values for the whole sequence at once.

Same contract as `reference.sparse_attention_reference` (official_code=False).
Letters: b batch, i query position, j key position, s selected slot, n key dim, e value dim,
c block index, r position within a block, m merged keys + queries, z any leading dims.
"""

import jax
import jax.numpy as jnp

from . import local
from .reference import running_buckets

# Gathered elements (query x slot x feature) per attention block: keeps the live block small
# (a few MiB) while leaving enough work per lax.map step to amortise its overhead.
BLOCK_ELEMENTS = 1 << 20


def _sw_indices(l, kc):
    """Sliding window: j = i - s for s < kc; valid while j >= 0."""
    j_is = jnp.arange(l, dtype=jnp.int32)[:, None] - jnp.arange(kc, dtype=jnp.int32)[None, :]
    return j_is, j_is >= 0


def _sink_indices(l, kc):
    """Sinks: j = s for s < kc; valid while j <= i."""
    j_is = jnp.broadcast_to(jnp.arange(kc, dtype=jnp.int32)[None, :], (l, kc))
    return j_is, j_is <= jnp.arange(l, dtype=jnp.int32)[:, None]


def _dilated_indices(l, kc, d):
    """Dilated: the kc most recent j <= i with j % d == d - 1, stepping back by d."""
    last_i = ((jnp.arange(l, dtype=jnp.int32) + 1) // d) * d - 1  # -1 when none yet
    j_is = last_i[:, None] - d * jnp.arange(kc, dtype=jnp.int32)[None, :]
    return j_is, j_is >= 0


def _lsh_indices(bucket_q_bl, bucket_k_bl, kc):
    """The kc most recent keys j <= i with bucket_k[j] == bucket_q[i], by one merged sort.

    Keys and queries are sorted together by (bucket, 2 * position + is_query), so key i sorts
    just before query i. In that order the keys alone are the keys sorted by (bucket, position);
    the number of keys up to a query is one past the last key with (bucket, j) <= (bucket_q, i),
    and the kc entries ending there that still hold bucket_q are the most recent matches.
    """
    b, l = bucket_k_bl.shape
    pos_l = jnp.arange(l, dtype=jnp.int32)
    bucket_bm = jnp.concatenate([bucket_k_bl, bucket_q_bl], axis=1)
    order_bm = jnp.broadcast_to(jnp.concatenate([2 * pos_l, 2 * pos_l + 1]), (b, 2 * l))
    src_bm = jnp.broadcast_to(jnp.arange(2 * l, dtype=jnp.int32), (b, 2 * l))
    _, _, src_bm = jax.lax.sort((bucket_bm, order_bm, src_bm), dimension=1, num_keys=2)
    is_key_bm = src_bm < l
    keys_upto_bm = jnp.cumsum(is_key_bm, axis=1, dtype=jnp.int32)

    def place(src_m, is_key_m, keys_upto_m):
        """Keys in sorted order, and each query's count of keys sorted at or before it."""
        out_of_range = 2 * l  # dropped by the scatter
        key_slot_m = jnp.where(is_key_m, keys_upto_m - 1, out_of_range)
        sorted_pos_l = jnp.zeros(l, jnp.int32).at[key_slot_m].set(src_m, mode="drop")
        query_slot_m = jnp.where(is_key_m, out_of_range, src_m - l)
        keys_upto_l = jnp.zeros(l, jnp.int32).at[query_slot_m].set(keys_upto_m, mode="drop")
        return sorted_pos_l, keys_upto_l

    sorted_pos_bl, keys_upto_bl = jax.vmap(place)(src_bm, is_key_bm, keys_upto_bm)
    slot_bis = keys_upto_bl[:, :, None] - 1 - jnp.arange(kc, dtype=jnp.int32)
    in_range_bis = slot_bis >= 0
    slot_bis = jnp.maximum(slot_bis, 0)
    j_bis = jnp.take_along_axis(sorted_pos_bl, slot_bis.reshape(b, -1), axis=1).reshape(b, l, kc)
    bucket_bis = jnp.take_along_axis(bucket_k_bl, j_bis.reshape(b, -1), axis=1).reshape(b, l, kc)
    return j_bis, in_range_bis & (bucket_bis == bucket_q_bl[:, :, None])


def ks_block_size(kc):
    """Key block of the running top-k: at least kc (so a block's candidates are not dominated by
    the carried top-kc) and at least 64, at most 256 (the per-block candidate matrix is
    block x (kc + block))."""
    return min(256, max(kc, 64))


def _ks_indices(key_scores_bl, kc):
    """Per query the top-kc of key_scores[0..i] (ties to the earlier position), by a lax.scan
    over key blocks carrying the running top-kc (scores, positions) of the earlier blocks."""
    b, l = key_scores_bl.shape
    block = ks_block_size(kc)
    nblocks = -(-l // block)
    scores_bl = jax.lax.stop_gradient(key_scores_bl.astype(jnp.float32))
    scores_bl = jnp.pad(scores_bl, [(0, 0), (0, nblocks * block - l)], constant_values=-jnp.inf)
    scores_cbr = jnp.moveaxis(scores_bl.reshape(b, nblocks, block), 1, 0)
    r_r = jnp.arange(block, dtype=jnp.int32)
    causal_rr = r_r[None, :] <= r_r[:, None]  # [query r, key r']

    def scan_block(carry, inputs):
        """Select for this block's queries, then fold the block's keys into the running top-kc."""
        run_scores_bs, run_pos_bs = carry
        blk_scores_br, c = inputs
        blk_pos_r = c * block + r_r
        # Candidates: the running top-kc (all earlier) first, then this block's keys in order,
        # so lax.top_k's lower-index-first tie rule gives ties to the earlier position.
        cand_scores_brt = jnp.concatenate(
            [
                jnp.broadcast_to(run_scores_bs[:, None, :], (b, block, kc)),
                jnp.where(causal_rr, blk_scores_br[:, None, :], -jnp.inf),
            ],
            axis=-1,
        )
        cand_pos_brt = jnp.concatenate(
            [
                jnp.broadcast_to(run_pos_bs[:, None, :], (b, block, kc)),
                jnp.broadcast_to(blk_pos_r, (b, block, block)),
            ],
            axis=-1,
        )
        best_brs, top_brs = jax.lax.top_k(cand_scores_brt, kc)
        j_brs = jnp.take_along_axis(cand_pos_brt, top_brs, axis=-1)
        # Empty running slots hold position -1; masked future keys a position > i; a key scored
        # -inf is never selected.
        valid_brs = (j_brs >= 0) & (j_brs <= blk_pos_r[:, None]) & (best_brs > -jnp.inf)
        merged_scores_bt = jnp.concatenate([run_scores_bs, blk_scores_br], axis=-1)
        merged_pos_bt = jnp.concatenate(
            [run_pos_bs, jnp.broadcast_to(blk_pos_r, (b, block))], axis=-1
        )
        run_scores_bs, top_bs = jax.lax.top_k(merged_scores_bt, kc)
        run_pos_bs = jnp.take_along_axis(merged_pos_bt, top_bs, axis=-1)
        return (run_scores_bs, run_pos_bs), (j_brs, valid_brs)

    init = (jnp.full((b, kc), -jnp.inf, jnp.float32), jnp.full((b, kc), -1, jnp.int32))
    _, (j_cbrs, valid_cbrs) = jax.lax.scan(
        scan_block, init, (scores_cbr, jnp.arange(nblocks, dtype=jnp.int32))
    )
    j_bis = jnp.moveaxis(j_cbrs, 0, 1).reshape(b, nblocks * block, kc)[:, :l]
    valid_bis = jnp.moveaxis(valid_cbrs, 0, 1).reshape(b, nblocks * block, kc)[:, :l]
    return j_bis, valid_bis


def selected_indices(q, k, *, spec, hash_proj=None, key_scores=None):
    """Key positions (b, l, num_keys') int32 and validity of every component, concatenated;
    num_keys' = kc * #components <= num_keys. May hold duplicates (see `dedupe`)."""
    b, l, _ = q.shape
    kc = spec.keys_per_component
    parts = []
    for comp in spec.components:
        if comp == "sw":
            part = _sw_indices(l, kc)
        elif comp == "sink":
            part = _sink_indices(l, kc)
        elif comp == "dilated":
            part = _dilated_indices(l, kc, spec.dilation)
        elif comp == "lsh":
            bucket_q_bl = running_buckets(q, hash_proj, spec.binning)
            bucket_k_bl = running_buckets(k, hash_proj, spec.binning)
            part = _lsh_indices(bucket_q_bl, bucket_k_bl, kc)
        elif comp == "ks":
            part = _ks_indices(key_scores, kc)
        else:
            raise ValueError(f"component {comp!r} has no indexed form (pattern {spec.pattern!r})")
        parts.append(tuple(jnp.broadcast_to(x, (b, l, kc)) for x in part))
    j_bis = jnp.concatenate([p[0] for p in parts], axis=-1)
    valid_bis = jnp.concatenate([p[1] for p in parts], axis=-1)
    return j_bis, valid_bis


def dedupe(j_zs, valid_zs):
    """Sort each row's positions and mask repeats and invalid slots (returned as position 0), so
    a key chosen by two components is counted once."""
    sentinel = jnp.iinfo(jnp.int32).max
    j_zs = jnp.sort(jnp.where(valid_zs, j_zs, sentinel), axis=-1)
    repeat_zs = jnp.concatenate(
        [jnp.zeros_like(j_zs[..., :1], bool), j_zs[..., 1:] == j_zs[..., :-1]], axis=-1
    )
    valid_zs = (j_zs != sentinel) & ~repeat_zs
    return jnp.where(valid_zs, j_zs, 0), valid_zs


def gather_rows(x_bjf, j_bzs):
    """x[b, j[b, ...]]: (b, ..., s, f) rows of x (b, l, f) at positions j (b, ..., s)."""
    return jax.vmap(lambda x_jf, j_zs: x_jf[j_zs])(x_bjf, j_bzs)


def softmax_attend(q_zn, k_zsn, v_zse, valid_zs):
    """Softmax over the valid slots only, fp32; rows with no valid slot give 0, zero grads."""
    scores_zs = jnp.einsum("...n,...sn->...s", q_zn, k_zsn)
    # Invalid slots are made finite before exp so they carry exact zeros, not NaN gradients.
    scores_zs = jnp.where(valid_zs, scores_zs, 0.0)
    max_z1 = jnp.max(jnp.where(valid_zs, scores_zs, -jnp.inf), axis=-1, keepdims=True)
    max_z1 = jax.lax.stop_gradient(jnp.where(jnp.isfinite(max_z1), max_z1, 0.0))
    weights_zs = jnp.where(valid_zs, jnp.exp(scores_zs - max_z1), 0.0)
    denom_z1 = jnp.sum(weights_zs, axis=-1, keepdims=True)
    o_ze = jnp.einsum("...s,...se->...e", weights_zs, v_zse)
    return o_ze / jnp.where(denom_z1 > 0, denom_z1, 1.0)


def attend_blocked(q_bin, k_bjn, v_bje, j_bis, valid_bis, block):
    """softmax_attend over gathered keys, `block` queries at a time (lax.map + checkpoint), so
    the backward pass re-gathers one block instead of storing (b, l, s, e)."""
    b, l, n = q_bin.shape
    nblocks = -(-l // block)
    pad = nblocks * block - l

    def blocks(x):
        """Pad the query axis and move the block axis to the front."""
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(b, nblocks, block, *x.shape[2:]), 1, 0)

    @jax.checkpoint
    def attend(inputs):
        """One block of queries."""
        q_brn, j_brs, valid_brs = inputs
        k_brsn, v_brse = gather_rows(k_bjn, j_brs), gather_rows(v_bje, j_brs)
        return softmax_attend(q_brn, k_brsn, v_brse, valid_brs)

    o_cbre = jax.lax.map(attend, (blocks(q_bin), blocks(j_bis), blocks(valid_bis)))
    return jnp.moveaxis(o_cbre, 0, 1).reshape(b, nblocks * block, -1)[:, :l]


def query_block_size(l, slots, n, e):
    """Queries per attention block: about BLOCK_ELEMENTS gathered elements, a power of two."""
    target = max(1, BLOCK_ELEMENTS // max(1, slots * (n + e)))
    block = 1 << (target.bit_length() - 1)
    return max(1, min(block, 1 << max(0, (l - 1).bit_length())))


def full_attention(q, k, v):
    """Dense causal softmax attention (the quadratic ceiling), fp32, output in v.dtype."""
    l = q.shape[1]
    q_bin, k_bjn, v_bje = (x.astype(jnp.float32) for x in (q, k, v))
    scores_bij = jnp.einsum("bin,bjn->bij", q_bin, k_bjn)
    pos_l = jnp.arange(l)
    causal_ij = pos_l[None, :] <= pos_l[:, None]
    probs_bij = jax.nn.softmax(jnp.where(causal_ij, scores_bij, -jnp.inf), axis=-1)
    return jnp.einsum("bij,bje->bie", probs_bij, v_bje).astype(v.dtype)


def sparse_attention_indexed(q, k, v, *, spec, hash_proj=None, key_scores=None, query_block=None):
    """Sparse attention by gathered keys; O(l * num_keys * (n + e)) time, O(l * num_keys) memory
    (plus one block of gathered keys). query_block=None picks `query_block_size` (and positional
    patterns take `local.local_attend`, no gather); 0 gathers the whole sequence at once. "full"
    goes to `full_attention`."""
    if spec.has("full"):
        return full_attention(q, k, v)
    if local.handles(spec) and query_block is None:
        return local.local_attend(*(x.astype(jnp.float32) for x in (q, k, v)), spec).astype(v.dtype)
    j_bis, valid_bis = selected_indices(q, k, spec=spec, hash_proj=hash_proj, key_scores=key_scores)
    j_bis, valid_bis = dedupe(j_bis, valid_bis)
    q_bin, k_bjn, v_bje = (x.astype(jnp.float32) for x in (q, k, v))
    b, l, n = q_bin.shape
    e = v_bje.shape[-1]
    if query_block is None:
        query_block = query_block_size(l, j_bis.shape[-1], n, e)
    if query_block == 0 or query_block >= l:
        o_bie = softmax_attend(
            q_bin, gather_rows(k_bjn, j_bis), gather_rows(v_bje, j_bis), valid_bis
        )
    else:
        o_bie = attend_blocked(q_bin, k_bjn, v_bje, j_bis, valid_bis, query_block)
    return o_bie.astype(v.dtype)
