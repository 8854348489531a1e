"""HAX sparse attention over a sequence split across "seq" (hax_jax.parallel's sequence
parallelism, for the attention branch): running sums across shards, and each shard's queries over
the earlier shards' carried keys (pallas_kernels.sparse_attention.carry)."""

import jax
import jax.numpy as jnp

from hax_jax.parallel import SEQ, from_earlier_shards, incoming_states, per_device, seq_shards
from pallas_kernels.sparse_attention import SparseSpec, carry, carry_pallas, sparse_attention
from pallas_kernels.sparse_attention.ops import picks_pallas


def sequence_cumsum(x: jax.Array) -> jax.Array:
    """jnp.cumsum(x, axis=1) in fp32 for x (b, l, f) whose positions may be split over "seq":
    each shard adds the sums of the shards before it (`incoming_states`), so no shard reads
    another's positions."""
    return per_device(
        _cumsum_shard,
        dict(x=x),
        dict(x=("batch", "seq", None)),
        [("batch", "seq", None)],
        seq_aware=True,
    )


def _cumsum_shard(x):
    """The shard's cumulative sums, offset by the earlier shards' totals."""
    local = jnp.cumsum(x.astype(jnp.float32), axis=1)
    before, _ = incoming_states(jnp.ones((), jnp.float32), local[:, -1])
    return local + before[:, None]


def sparse_attention_sequence_parallel(
    q, k, v, hash_proj, key_scores, *, spec: SparseSpec, impl
) -> jax.Array:
    """`pallas_kernels.sparse_attention` (of the attention `spec`) of this shard's queries over
    the whole prefix.

    One device (or an unsplit "seq"): the op itself. A split sequence: every shard publishes the
    keys later queries may select from it (`carry.summarise`: per LSH bucket the kc most recent,
    the kc best-scored, the last / first kc, the kc most recent dilated: the decode cache's
    contents), the summaries are all-gathered over "seq" (`from_earlier_shards`), and each
    shard's queries merge the earlier shards' into their own candidates: with the Pallas kernels
    by running them over the carried keys put in front of the shard's (`carry_pallas.attend`),
    else by gathering each query's candidates (`carry.attend_with_carry`). LSH centring uses
    the earlier shards' sums of q and k. "full" all-gathers K and V (the quadratic ceiling)."""
    shards = seq_shards()
    if shards == 1:
        return sparse_attention(
            q, k, v, spec=spec, hash_proj=hash_proj, key_scores=key_scores, impl=impl
        )
    if spec.official_code:
        raise ValueError(
            "sparse.official_code=True reads the whole sequence (non-causal centring and "
            "normalisation): it cannot run with the sequence split over mesh.seq > 1"
        )
    b, l, _ = q.shape
    offset = jax.lax.axis_index(SEQ) * l
    if spec.pattern == "full":
        k_all, v_all = (jax.lax.all_gather(x, SEQ, axis=1, tiled=True) for x in (k, v))
        return carry.full_attention_after(q, k_all, v_all, offset)
    zeros = jnp.zeros((b, q.shape[-1]), jnp.float32)
    q_sum_in = k_sum_in = zeros
    bucket_k = None
    if spec.has("lsh"):
        sums = jnp.sum(jnp.concatenate([q, k], axis=-1).astype(jnp.float32), axis=1)
        q_sum_in, k_sum_in = jnp.split(incoming_states(jnp.ones(()), sums)[0], 2, axis=-1)
        bucket_k = carry.buckets_after(k, k_sum_in, offset, hash_proj, spec.binning)
    summary = carry.summarise(k, v, key_scores, bucket_k, offset, spec)
    # Keys and values travel as one array (one collective there and one back); positions,
    # buckets and the scores' bits (they only select: no gradient) as another.
    n = k.shape[-1]
    kv = jnp.concatenate([summary.k, summary.v.astype(summary.k.dtype)], axis=-1)
    score_bits = jax.lax.bitcast_convert_type(summary.score, jnp.int32)
    ints = [summary.pos, score_bits] + ([] if bucket_k is None else [summary.bucket])
    ints, kv = (from_earlier_shards(x, axis=1) for x in (jnp.stack(ints, axis=-1), kv))
    gathered = carry.Summary(
        ints[..., 0],
        kv[..., :n],
        kv[..., n:].astype(v.dtype),
        jax.lax.bitcast_convert_type(ints[..., 1], jnp.float32),
        None if bucket_k is None else ints[..., 2],
    )
    if picks_pallas(spec, impl):
        bucket_q = None
        if spec.has("lsh"):
            bucket_q = carry.buckets_after(q, q_sum_in, offset, hash_proj, spec.binning)
        return carry_pallas.attend(
            q,
            k,
            v,
            key_scores,
            bucket_q,
            bucket_k,
            gathered,
            spec=spec,
            offset=offset,
            shards=shards,
        )
    return carry.attend_with_carry(
        q,
        k,
        v,
        key_scores,
        hash_proj,
        gathered,
        spec=spec,
        offset=offset,
        shards=shards,
        q_sum_in=q_sum_in,
        k_sum_in=k_sum_in,
    )
