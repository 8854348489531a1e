"""HAX sparse attention of one sequence shard by the Pallas kernels, given the earlier shards' keys.

On one device query i attends to the kc most recent keys of its LSH bucket and the kc best-scored
keys among positions 0..i. What the earlier shards can add to those sets is bounded: per bucket
their kc most recent keys, and their kc best-scored keys (`carry.carried_rows`: the decode cache's
contents). So the shard's kernels run over one longer sequence, those carried keys first (in their
global order, each once), then the shard's own positions, then rows nothing can reach:

    [carried keys (c of them) | the shard's queries and keys (l) | empty (R - c)]

Over it the kernels' own rules (the kc most recent of a bucket at or before i; the kc best scores at
or before i, ties to the earlier key; a key in both sets counted once) select exactly the keys one
device selects over the whole prefix: a carried key outside both of those bounded sets is never
picked, because every key that outranks it is carried too. Buckets are centred over the whole
prefix (`carry.buckets_after`); carried keys keep their own. The carried rows' queries are inert
(the extra bucket n_buckets, which no key before them has; their outputs dropped) and the empty rows
come after every query, so no causal rule reaches them. Gradients of the carried keys and values
go back through the gather to the shards that published them.

Letters: b batch, t local position, r carried row, x position in the longer sequence.
"""

import jax
import jax.numpy as jnp

from .carry import EMPTY, Summary, carried_rows, dedupe_rows
from .ops import sparse_attention_of_layout
from .pallas import layout_of
from .spec import SparseSpec
from .tiling import BlockSizes


def attend(
    q, k, v, key_scores, bucket_q, bucket_k, gathered: Summary, *, spec: SparseSpec, offset, shards
):
    """o (b, l, e) of the shard at global `offset` (patterns lsh, ks, lsh+ks).

    q, k (b, l, n), v (b, l, e), key_scores (b, l) (ks) and bucket_q, bucket_k (b, l) (lsh, centred
    over the whole prefix) are this shard's; `gathered` every shard's `carry.summarise`, with
    buckets when the pattern has lsh."""
    b, l, _ = q.shape
    rows = carried_rows(gathered, offset, shards, spec, l)
    rows_br = jnp.concatenate([rows[c].reshape(b, -1) for c in spec.components], axis=1)
    r = rows_br.shape[1]
    # Each carried key once, in global order (rows sorted by position, repeats dropped).
    pos_b1r = jnp.take_along_axis(gathered.pos, jnp.maximum(rows_br, 0), 1)[:, None]
    at_b1r, real_b1r = dedupe_rows(pos_b1r, rows_br[:, None], (rows_br != EMPTY)[:, None])
    at_br, real_br = at_b1r[:, 0], real_b1r[:, 0]
    count_b = jnp.sum(real_br, axis=1)
    slot_br = jnp.where(real_br, jnp.cumsum(real_br, axis=1) - 1, r + l)  # r + l: dropped
    x_bt = count_b[:, None] + jnp.arange(l, dtype=jnp.int32)

    def longer(carried, local, fill):
        """[carried | local | fill] (b, r + l, ...): each row at its place in the sequence."""

        def one(c, lo, s, x):
            out = jnp.full((r + l, *lo.shape[1:]), fill, lo.dtype)
            return out.at[s].set(c.astype(lo.dtype), mode="drop").at[x].set(lo)

        return jax.vmap(one)(carried, local, slot_br, x_bt)

    def taken(x):
        """The carried rows of x (b, S * R, ...) from `gathered`."""
        return jnp.take_along_axis(x, at_br.reshape(b, r, *([1] * (x.ndim - 2))), axis=1)

    q_x = longer(jnp.zeros((b, r, q.shape[2]), q.dtype), q, 0)
    k_x, v_x = longer(taken(gathered.k), k, 0), longer(taken(gathered.v), v, 0)
    buckets = scores = None
    inert = spec.num_buckets if spec.has("lsh") else 0  # carried queries' and empty rows' bucket
    if spec.has("lsh"):
        bucket_q_x = longer(jnp.full((b, r), inert, jnp.int32), bucket_q.astype(jnp.int32), inert)
        bucket_k_x = longer(taken(gathered.bucket), bucket_k.astype(jnp.int32), inert)
        buckets = (bucket_q_x, bucket_k_x)
    if spec.has("ks"):
        own = jax.lax.stop_gradient(key_scores.astype(jnp.float32))
        scores = longer(taken(gathered.score), own, -jnp.inf)
    blocks = BlockSizes()
    layout = layout_of(buckets, scores, spec=spec, blocks=blocks, n_buckets=inert + 1)
    o_x = sparse_attention_of_layout(q_x, k_x, v_x, layout, spec, blocks=blocks)
    return jnp.take_along_axis(o_x, x_bt[..., None], axis=1)
