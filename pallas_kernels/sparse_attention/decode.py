"""HAX sparse attention decoding: one step against a cache, O(num_keys * (n + e)) per token, and
the cache after a whole prompt, built in parallel.

The cache keeps what each component needs to find query t's keys without reading all
`capacity` rows: the running sums for the LSH centring, a per-bucket table of the kc most recent
key positions, and the running top-kc key scores. A step touches O(num_keys) rows of the key
and value buffers (plus the append); only "full" reads every row (the quadratic ceiling).

Running the step over positions 0..l-1 gives the parallel op's outputs (same selection rules
and the same tie-breaking). Letters: b batch, c capacity (cache position), s selected slot,
n key dim, e value dim, u bucket.

From an empty cache (t = 0), `prefill_arrays` returns the cache that l calls of
`step_arrays` leave (positions 0..l-1), with no loop over positions: the buffers by one
slice update, the sums by a reduction, the LSH table by one sort of the keys by (bucket,
position), the running top-kc key scores by one lax.top_k. O(l log l) time and O(l) extra memory
beside the cache itself; never an (l, l) array.

Letters: b batch, l length (position), c capacity, n key dim, e value dim, u bucket, s slot.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .indexed import dedupe, gather_rows, softmax_attend
from .reference import centred, lsh_buckets, running_buckets


class LinearScore(NamedTuple):
    """A key score given as the last layer of the scorer that makes it: value = features @ weight +
    bias, for a step to take instead of the score itself (the Pallas step computes it inside its
    kernel, saving the GEMV and bias kernels a layer and token). features (b, m) float, weight
    (m,) float, bias () float."""

    features: jax.Array
    weight: jax.Array
    bias: jax.Array

    def value(self) -> jax.Array:
        """The scores (b,) fp32."""
        features = self.features.astype(jnp.float32)
        return features @ self.weight.astype(jnp.float32) + self.bias.astype(jnp.float32)


class SparseAttentionCache(NamedTuple):
    """Decode state of `sparse_attention_step`.

    keys (b, capacity, n), values (b, capacity, e): rows 0..t-1 written so far.
    t: int32 scalar, the number of positions seen = the position the next step writes; a
        NumPy zero in a fresh cache (concrete even under jit), a jax array after a step.
    q_sum, k_sum (b, n) fp32: sums of all queries / keys seen BEFORE the next step (positions
        0..t-1); the running means for the LSH centring are (sum + x_t) / (t + 1). A caller may
        read q_sum to reproduce the centring.
    lsh_table (b, n_buckets, kc) int32: per key bucket the kc most recent positions, oldest
        first, -1 = empty; (b, 0, 0) without lsh.
    ks_scores (b, kc) fp32, ks_pos (b, kc) int32: the running top-kc key scores (descending,
        ties earlier first) and their positions, -inf / -1 = empty; (b, 0) without ks.
    """

    keys: jax.Array
    values: jax.Array
    t: jax.Array
    q_sum: jax.Array
    k_sum: jax.Array
    lsh_table: jax.Array
    ks_scores: jax.Array
    ks_pos: jax.Array


def init_cache_arrays(batch, capacity, n, e, *, spec, dtype):
    """An empty cache (no validation; see ops.init_cache)."""
    kc = spec.keys_per_component
    lsh_shape = (batch, spec.num_buckets, kc) if spec.has("lsh") else (batch, 0, 0)
    ks_len = kc if spec.has("ks") else 0
    return SparseAttentionCache(
        keys=jnp.zeros((batch, capacity, n), dtype),
        values=jnp.zeros((batch, capacity, e), dtype),
        # NumPy, not jnp: a cache made inside a traced function still has a concrete t = 0, which
        # tells a prefill that it may build the cache in parallel (see ops.prefill_cache).
        t=np.zeros((), np.int32),
        q_sum=jnp.zeros((batch, n), jnp.float32),
        k_sum=jnp.zeros((batch, n), jnp.float32),
        lsh_table=jnp.full(lsh_shape, -1, jnp.int32),
        ks_scores=jnp.full((batch, ks_len), -jnp.inf, jnp.float32),
        ks_pos=jnp.full((batch, ks_len), -1, jnp.int32),
    )


def step_arrays(q, k, v, cache, *, spec, hash_proj=None, key_score=None):
    """One decode step (no validation; see ops.sparse_attention_step): returns (o, cache).
    key_score: (b,) or a LinearScore.

    Past capacity the buffers cannot take the new row, so o is NaN there (a traced t cannot
    raise); ops.sparse_attention_step raises instead when t is concrete.
    """
    kc = spec.keys_per_component
    b, capacity, _ = cache.keys.shape
    t = cache.t
    batch_b = jnp.arange(b)
    keys = jax.lax.dynamic_update_slice(cache.keys, k[:, None].astype(cache.keys.dtype), (0, t, 0))
    values = jax.lax.dynamic_update_slice(
        cache.values, v[:, None].astype(cache.values.dtype), (0, t, 0)
    )
    q_bn, k_bn = q.astype(jnp.float32), k.astype(jnp.float32)
    q_sum, k_sum = cache.q_sum + q_bn, cache.k_sum + k_bn
    lsh_table, ks_scores, ks_pos = cache.lsh_table, cache.ks_scores, cache.ks_pos
    s_s = jnp.arange(kc, dtype=jnp.int32)
    parts = []
    for comp in spec.components:
        if comp == "full":
            j_bs = jnp.broadcast_to(jnp.arange(capacity, dtype=jnp.int32), (b, capacity))
            parts.append((j_bs, j_bs <= t))
        elif comp == "sw":
            parts.append((t - s_s, t - s_s >= 0))
        elif comp == "sink":
            parts.append((s_s, s_s <= t))
        elif comp == "dilated":
            d = spec.dilation
            j_s = ((t + 1) // d) * d - 1 - d * s_s
            parts.append((j_s, j_s >= 0))
        elif comp == "lsh":
            # k and q stacked: one centring and one hash projection for both (fewer ops a token).
            count = (t + 1).astype(jnp.float32)
            kq_c_2bn, kq_scale_2b = centred(
                jnp.stack([k_bn, q_bn]), jnp.stack([k_sum, q_sum]) / count
            )
            bucket_k_b, bucket_q_b = lsh_buckets(kq_c_2bn, hash_proj, spec.binning, kq_scale_2b)
            # Push t into its key bucket's row (drop the oldest), then read the query's row.
            row_bs = lsh_table[batch_b, bucket_k_b]
            row_bs = jnp.concatenate([row_bs[:, 1:], jnp.full((b, 1), t, jnp.int32)], axis=1)
            lsh_table = lsh_table.at[batch_b, bucket_k_b].set(row_bs)
            j_bs = lsh_table[batch_b, bucket_q_b]
            parts.append((j_bs, j_bs >= 0))
        else:  # ks
            if isinstance(key_score, LinearScore):
                key_score = key_score.value()
            score_b1 = jax.lax.stop_gradient(key_score.astype(jnp.float32))[:, None]
            ks_scores, ks_pos = insert_top(ks_scores, ks_pos, score_b1, t)
            parts.append((ks_pos, ks_pos >= 0))
    j_bs = jnp.concatenate([jnp.broadcast_to(p[0], (b, p[0].shape[-1])) for p in parts], -1)
    valid_bs = jnp.concatenate([jnp.broadcast_to(p[1], (b, p[1].shape[-1])) for p in parts], -1)
    if len(spec.components) > 1:  # one component never selects a position twice
        j_bs, valid_bs = step_dedupe(j_bs, valid_bs)
    else:  # empty slots (-1, or before position 0) read row 0, as `dedupe` leaves them
        j_bs = jnp.where(valid_bs, j_bs, 0)
    k_bsn = gather_rows(keys, j_bs).astype(jnp.float32)
    v_bse = gather_rows(values, j_bs).astype(jnp.float32)
    o_be = softmax_attend(q_bn, k_bsn, v_bse, valid_bs)
    o_be = jnp.where(t < capacity, o_be, jnp.nan).astype(v.dtype)
    new_cache = SparseAttentionCache(
        keys=keys,
        values=values,
        t=t + 1,
        q_sum=q_sum,
        k_sum=k_sum,
        lsh_table=lsh_table,
        ks_scores=ks_scores,
        ks_pos=ks_pos,
    )
    return o_be, new_cache


# Up to this many slots a step finds repeats by comparing every pair (one fused op, no sort).
PAIRWISE_DEDUPE_SLOTS = 256


def step_dedupe(j_bs, valid_bs):
    """`dedupe` for one query a row: each position counted once (repeats and invalid slots
    masked, returned as position 0). A few slots compare every pair, keeping a position's first
    slot; many ("full" beside another component) sort, as `dedupe` does."""
    slots = j_bs.shape[-1]
    if slots > PAIRWISE_DEDUPE_SLOTS:
        return dedupe(j_bs, valid_bs)
    earlier_ss = jnp.arange(slots)[None, :] < jnp.arange(slots)[:, None]
    same_bss = (j_bs[:, :, None] == j_bs[:, None, :]) & valid_bs[:, None, :] & earlier_ss
    valid_bs = valid_bs & ~jnp.any(same_bss, axis=-1)
    return jnp.where(valid_bs, j_bs, 0), valid_bs


def insert_top(scores_bs, pos_bs, score_b1, t):
    """The running top-kc (scores descending, ties earlier first) with position t's score added,
    as lax.top_k of the scores with the new one last would keep them: it goes after every kept
    score >= it, the rest move down one slot and the last drops out. Elementwise (no sort)."""
    slot_s = jnp.arange(scores_bs.shape[-1])
    at_b1 = jnp.sum(scores_bs >= score_b1, axis=-1, keepdims=True)
    down_scores = jnp.concatenate([score_b1, scores_bs[:, :-1]], axis=-1)
    down_pos = jnp.concatenate([jnp.full_like(pos_bs[:, :1], t), pos_bs[:, :-1]], axis=-1)
    before, here = slot_s < at_b1, slot_s == at_b1
    scores_bs = jnp.where(before, scores_bs, jnp.where(here, score_b1, down_scores))
    pos_bs = jnp.where(before, pos_bs, jnp.where(here, t, down_pos))
    return scores_bs, pos_bs


# ---------------------------------------------------------------- prefill


def lsh_table_of(bucket_k_bl, n_buckets, kc):
    """The step's LSH table (b, n_buckets, kc) int32 after keys 0..l-1 with buckets bucket_k:
    per bucket the kc most recent positions, oldest first, -1 in the leading empty slots."""
    b, l = bucket_k_bl.shape
    pos_bl = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
    # Sorted by (bucket, position): each bucket's keys form one run, oldest first.
    sorted_bucket_bl, sorted_pos_bl = jax.lax.sort(
        (bucket_k_bl.astype(jnp.int32), pos_bl), dimension=1, num_keys=2
    )
    return jax.vmap(lambda u_l, j_l: _table_row(u_l, j_l, n_buckets, kc))(
        sorted_bucket_bl, sorted_pos_bl
    )


def _table_row(sorted_bucket_l, sorted_pos_l, n_buckets, kc):
    """One sequence's table (n_buckets, kc) from its keys sorted by (bucket, position)."""
    l = sorted_bucket_l.shape[0]
    r_l = jnp.arange(l, dtype=jnp.int32)
    # end[r]: one past the last sorted key of r's bucket (each run's end, carried back over the
    # run by a reversed cumulative min), so end - 1 - r keys of that bucket are newer than r.
    last_l = jnp.append(sorted_bucket_l[1:] != sorted_bucket_l[:-1], True)
    end_l = jax.lax.cummin(jnp.where(last_l, r_l + 1, l), reverse=True)
    # The step shifts a row left per push: the newest sits in slot kc - 1, and r in slot
    # kc - 1 - (end - 1 - r) = kc - end + r.
    slot_l = kc - end_l + r_l
    # Keys older than the kc newest were pushed out; slot kc is out of range, so dropped (a
    # negative index would wrap instead).
    slot_l = jnp.where(slot_l >= 0, slot_l, kc)
    table_us = jnp.full((n_buckets, kc), -1, jnp.int32)
    return table_us.at[sorted_bucket_l, slot_l].set(sorted_pos_l, mode="drop")


def ks_top_of(key_scores_bl, kc):
    """The step's running top-kc after keys 0..l-1: (scores (b, kc) fp32 descending, positions
    (b, kc) int32), ties to the earlier position, -inf / -1 where empty."""
    b, l = key_scores_bl.shape
    scores_bl = jax.lax.stop_gradient(key_scores_bl.astype(jnp.float32))
    # The kc empty slots go first, as in the step's running list, and lax.top_k keeps the lower
    # index of a tie: so equal scores go to the earlier position, and a -inf score never takes
    # an empty slot (the step drops it as the last of the tied -inf entries).
    merged_scores_bm = jnp.concatenate([jnp.full((b, kc), -jnp.inf, jnp.float32), scores_bl], 1)
    pos_bl = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
    merged_pos_bm = jnp.concatenate([jnp.full((b, kc), -1, jnp.int32), pos_bl], 1)
    top_scores_bs, top_bs = jax.lax.top_k(merged_scores_bm, kc)
    return top_scores_bs, jnp.take_along_axis(merged_pos_bm, top_bs, axis=1)


def prefill_arrays(q, k, v, cache, *, spec, hash_proj=None, key_scores=None):
    """The cache after positions 0..l-1 from an EMPTY cache (no validation; see
    ops.prefill_cache): q, k (b, l, n), v (b, l, e), key_scores (b, l); capacity >= l. Dilated
    keeps no state: its keys follow from t alone."""
    kc = spec.keys_per_component
    l = q.shape[1]
    keys = jax.lax.dynamic_update_slice(cache.keys, k.astype(cache.keys.dtype), (0, 0, 0))
    values = jax.lax.dynamic_update_slice(cache.values, v.astype(cache.values.dtype), (0, 0, 0))
    lsh_table, ks_scores, ks_pos = cache.lsh_table, cache.ks_scores, cache.ks_pos
    if spec.has("lsh"):
        # The step buckets key t at step t, centred by the running mean over 0..t (itself
        # included): exactly the parallel op's causal running_buckets.
        bucket_k_bl = running_buckets(k, hash_proj, spec.binning)
        lsh_table = lsh_table_of(bucket_k_bl, spec.num_buckets, kc)
    if spec.has("ks"):
        ks_scores, ks_pos = ks_top_of(key_scores, kc)
    return SparseAttentionCache(
        keys=keys,
        values=values,
        t=jnp.full((), l, jnp.int32),
        q_sum=cache.q_sum + jnp.sum(q.astype(jnp.float32), axis=1),
        k_sum=cache.k_sum + jnp.sum(k.astype(jnp.float32), axis=1),
        lsh_table=lsh_table,
        ks_scores=ks_scores,
        ks_pos=ks_pos,
    )
