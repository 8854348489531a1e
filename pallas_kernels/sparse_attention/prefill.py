"""HAX sparse attention: the decode cache after a whole prompt, built in parallel.

From an empty cache (t = 0), `prefill_arrays` returns the cache that l calls of
`step.step_arrays` leave (positions 0..l-1), with no loop over positions: the buffers by one
slice update, the sums by a reduction, the LSH table by one sort of the keys by (bucket,
position), the running top-kc key scores by one lax.top_k. O(l log l) time and O(l) extra memory
beside the cache itself; never an (l, l) array.

Letters: b batch, l length (position), c capacity, n key dim, e value dim, u bucket, s slot.
"""

import jax
import jax.numpy as jnp

from .reference import running_buckets
from .step import SparseAttentionCache


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
