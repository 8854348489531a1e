"""HAX sparse attention of one sequence shard by the Pallas kernels, given the earlier shards' keys.

On one device query i attends to the kc most recent keys of its LSH bucket and the kc best-scored
keys among positions 0..i. What the earlier shards can add to those sets is bounded: per bucket
their kc most recent keys, and their kc best-scored keys (`carry.carried_rows`: the decode cache's
contents). So the shard's kernels run over one longer sequence of keys, the carried rows first,
each key once and in global order, then the shard's own positions:

    keys     [carried keys (c) | empty rows (r - c) | the shard's keys (l)]
    queries                                          [the shard's queries (l)]

The queries are the last l key positions (the kernels compute nothing for the carried rows; as
queries they took a quarter of a 64K shard's sparse-attention time on H200). r is rounded up to
the kernels' block, so the shard's rows sit at a fixed offset and the keys are a concatenation.
Over them the kernels' own rules (the kc most recent of a bucket at or before i; the kc best
scores at or before i, ties to the earlier key; a key in both sets counted once) select exactly
the keys one device selects over the whole prefix: a carried key outside both of those bounded
sets is never picked, because every key that outranks it is carried too. Buckets are centred
over the whole prefix (`carry.buckets_after`); carried keys keep their own. Empty rows (and a key
carried twice, after its first copy) are inert: bucket n_buckets, which no query has, and score
-inf, which the ks selection never takes (tiling.ks_layout). Gradients of the carried keys and
values go back through the gather to the shards that published them.

Letters: b batch, t local position, r carried row, x position in the longer sequence.
"""

import jax
import jax.numpy as jnp

from .carry import EMPTY, Summary, carried_rows, dedupe_rows, take_rows
from .ops import sparse_attention_of_layout
from .pallas import layout_of, padded_length
from .spec import SparseSpec, selected
from .tiling import BlockSizes


def attend(
    q, k, v, key_scores, bucket_q, bucket_k, gathered: Summary, *, spec: SparseSpec, offset, shards
):
    """o (b, l, e) of the shard at global `offset` (patterns lsh, ks, lsh+ks).

    q, k (b, l, n), v (b, l, e), key_scores (b, l) (ks) and bucket_q, bucket_k (b, l) (lsh, centred
    over the whole prefix) are this shard's; `gathered` every shard's `carry.summarise`, with
    buckets when the pattern has lsh."""
    b, l, _ = q.shape
    blocks = BlockSizes()
    rows = carried_rows(gathered, offset, shards, spec, l)
    rows_br = jnp.concatenate([rows[c].reshape(b, -1) for c in spec.components], axis=1)
    r = padded_length(rows_br.shape[1], blocks)  # the queries start at a block
    rows_br = jnp.pad(rows_br, [(0, 0), (0, r - rows_br.shape[1])], constant_values=EMPTY)
    # Each carried key once, in global order, then the empty rows.
    pos_br = jnp.take_along_axis(gathered.pos, jnp.maximum(rows_br, 0), axis=1)
    at_br, real_br = selected(dedupe_rows(pos_br, rows_br, rows_br != EMPTY))

    def longer(carried, local, fill):
        """[carried (fill where empty) | local] (b, r + l, ...)."""
        real = real_br.reshape(b, r, *([1] * (local.ndim - 2)))
        return jnp.concatenate([jnp.where(real, carried.astype(local.dtype), fill), local], axis=1)

    k_x = longer(take_rows(gathered.k, at_br, real_br), k, 0)
    v_x = longer(take_rows(gathered.v, at_br, real_br), v, 0)
    buckets = scores = None
    inert = spec.num_buckets if spec.has("lsh") else 0  # the empty rows' bucket
    if spec.has("lsh"):
        bucket_k_x = longer(
            take_rows(gathered.bucket, at_br, real_br), bucket_k.astype(jnp.int32), inert
        )
        buckets = (bucket_q.astype(jnp.int32), bucket_k_x)
    if spec.has("ks"):
        own = jax.lax.stop_gradient(key_scores.astype(jnp.float32))
        scores = longer(take_rows(gathered.score, at_br, real_br), own, -jnp.inf)
    layout = layout_of(buckets, scores, spec=spec, blocks=blocks, n_buckets=inert + 1, n_queries=l)
    return sparse_attention_of_layout(q, k_x, v_x, layout, spec, blocks=blocks)
