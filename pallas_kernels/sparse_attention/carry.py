"""HAX sparse attention of one piece of a sequence, given what the earlier pieces leave behind.

Sequence parallelism splits the sequence into contiguous shards; query i of shard s attends to
the union of its components' keys over the WHOLE prefix 0..i, as on one device. Every component
keeps a bounded set of the earlier keys that any later query can select, exactly what the decode
cache holds (decode.py): per LSH bucket the kc most recent keys, the kc best-scored keys (ks), the
last kc keys (sw), the first kc keys (sink), the kc most recent dilated keys. So each shard
publishes a `Summary` of its own keys (those sets, computed over the shard alone), the caller
gathers every shard's summary (one all-gather), and `attend_with_carry` merges the summaries of
the earlier shards into each query's candidates beside its local ones: per component the kc best
of (local candidates + carried candidates) by that component's own rule, then one softmax over the
union. Buckets centre q and k by running means over the whole prefix (`sum_in`: the earlier
shards' sums). O(l * num_keys * (n + e)) per shard plus the summaries; no (l, l) array.

Letters: b batch, t local position, r summary row, s slot, u bucket, n key dim, e value dim.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from .decode import lsh_table_of
from .indexed import _ks_indices, _lsh_indices, attend_blocked, query_block_size
from .reference import centred, lsh_buckets
from .spec import SparseSpec, selected

EMPTY = -1  # the position of an empty summary row


class Summary(NamedTuple):
    """A shard's keys that later queries may select, as rows (b, r): global position (EMPTY for
    a padding row), key, value and key score (zeros without ks). LSH rows come as a table, kc
    per bucket, so their buckets need not travel."""

    pos: jax.Array  # (b, r) int32
    k: jax.Array  # (b, r, n)
    v: jax.Array  # (b, r, e)
    score: jax.Array  # (b, r) fp32
    bucket: jax.Array | None = None  # (b, r) int32: the key's LSH bucket (patterns with lsh)


def buckets_after(x_bln, sum_in_bn, offset, hash_proj, binning):
    """LSH buckets of x (b, l, n) centred by the running mean over the whole prefix: the earlier
    shards' sum `sum_in` (b, n) and `offset` positions before this shard."""
    cum_bln = sum_in_bn[:, None] + jnp.cumsum(x_bln.astype(jnp.float32), axis=1)
    count_l = offset + jnp.arange(1, x_bln.shape[1] + 1, dtype=jnp.float32)
    x_c_bln, scale_bl = centred(x_bln, cum_bln / count_l[:, None])
    return lsh_buckets(x_c_bln, hash_proj, binning, scale_bl)


def summarise(k, v, key_scores, bucket_k, offset, spec: SparseSpec):
    """The `Summary` of a shard at global `offset`: per component of `spec` the kc keys later
    queries may select from it (rows of different components may repeat a key)."""
    b, l, _ = k.shape
    kc = spec.keys_per_component
    pos_l = offset + jnp.arange(l, dtype=jnp.int32)
    rows = []  # local positions (b, kc'), EMPTY for none
    for comp in spec.components:
        if comp == "lsh":
            table_bus = lsh_table_of(bucket_k, spec.num_buckets, kc)
            rows.append(table_bus.reshape(b, -1))
        elif comp == "ks":
            top = jax.lax.top_k(jax.lax.stop_gradient(key_scores.astype(jnp.float32)), min(kc, l))
            rows.append(top[1].astype(jnp.int32))
        elif comp == "sw":
            rows.append(
                jnp.broadcast_to(jnp.arange(l - min(kc, l), l, dtype=jnp.int32), (b, min(kc, l)))
            )
        elif comp == "sink":
            rows.append(jnp.broadcast_to(jnp.arange(min(kc, l), dtype=jnp.int32), (b, min(kc, l))))
        elif comp == "dilated":
            d = spec.dilation
            last = ((offset + l) // d) * d - 1 - offset  # the shard's last dilated position
            j_s = last - d * jnp.arange(kc, dtype=jnp.int32)
            rows.append(jnp.broadcast_to(jnp.where(j_s >= 0, j_s, EMPTY), (b, kc)))
    rows = selected(rows)
    local_br = jnp.concatenate(rows, axis=1)
    valid_br = local_br >= 0

    def take(x):
        """The summary rows of x (b, l, ...): per component, whose rows are distinct keys."""
        return jnp.concatenate([take_rows(x, jnp.maximum(r, 0), r >= 0) for r in rows], axis=1)

    scores = jnp.zeros((b, l), jnp.float32) if key_scores is None else key_scores
    return Summary(
        pos=jnp.where(valid_br, pos_l[jnp.maximum(local_br, 0)], EMPTY),
        k=take(k),
        v=take(v),
        score=take(jax.lax.stop_gradient(scores.astype(jnp.float32))),
        bucket=None if bucket_k is None else take(bucket_k),
    )


def take_rows(x, at_br, valid_br):
    """x[b, at[b, r]] for x (b, t, ...): rows (b, r, ...). The valid rows must take distinct
    positions, and the others must be placeholders no gradient reaches (their cotangent is
    dropped). The gradient is then a gather by the inverse map instead of a scatter-add into zeros:
    XLA made every layer's zero buffers in the forward (7.1 GiB in a 64K HAX step on seq=2, H200),
    and the bf16 scatter-add took 25.9 ms of that step."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        return _take_unique_rows(x, at_br, valid_br)
    return _rows_at(x, at_br)


def _rows_at(x, at_br):
    """take_along_axis of x (b, t, ...) at rows (b, r)."""
    return jnp.take_along_axis(x, at_br.reshape(*at_br.shape, *([1] * (x.ndim - 2))), axis=1)


@jax.custom_vjp
def _take_unique_rows(x, at_br, valid_br):
    return _rows_at(x, at_br)


def _take_unique_rows_fwd(x, at_br, valid_br):
    # x's length and dtype ride along as an empty array (residuals are arrays).
    return _take_unique_rows(x, at_br, valid_br), (
        at_br,
        valid_br,
        jnp.zeros((x.shape[1], 0), x.dtype),
    )


def _take_unique_rows_bwd(residuals, dy_br):
    at_br, valid_br, like = residuals
    b, r = at_br.shape
    t = like.shape[0]

    def inverse(slots):
        """For each of the t positions, the row that took it (-1: none)."""
        rows = jnp.arange(r, dtype=jnp.int32)
        return jnp.full((t,), -1, jnp.int32).at[slots].set(rows, mode="drop")

    row_bt = jax.vmap(inverse)(jnp.where(valid_br, at_br, t))
    dx = _rows_at(dy_br, jnp.maximum(row_bt, 0))
    taken = (row_bt >= 0).reshape(b, t, *([1] * (dy_br.ndim - 2)))
    return jnp.where(taken, dx, 0).astype(like.dtype), None, None


_take_unique_rows.defvjp(_take_unique_rows_fwd, _take_unique_rows_bwd)


def _block_sizes(spec, l):
    """Rows of each component's block in a shard's summary, in pattern order."""
    kc = spec.keys_per_component
    sizes = {"ks": min(kc, l), "sw": min(kc, l), "sink": min(kc, l), "dilated": kc}
    return [
        (comp, spec.num_buckets * kc if comp == "lsh" else sizes[comp]) for comp in spec.components
    ]


def carried_rows(gathered: Summary, offset, shards, spec, l):
    """Per component, rows of `gathered` (the summaries of all shards, flattened to (b, S * R))
    that queries of the shard at `offset` may take from the earlier shards, as row indices
    (EMPTY for none): lsh (b, u, kc) and dilated (b, kc) most recent first, ks (b, kc) best
    first (ties: earlier), sw (b, kc) by position offset - kc + s, sink (b, kc) by position s."""
    b = gathered.pos.shape[0]
    kc = spec.keys_per_component
    per_shard = sum(size for _, size in _block_sizes(spec, l))
    earlier_bR = (gathered.pos != EMPTY) & (gathered.pos < offset)
    row_R = jnp.arange(gathered.pos.shape[1], dtype=jnp.int32)
    out, start = {}, 0
    for comp, size in _block_sizes(spec, l):
        rows_S = start + per_shard * jnp.arange(shards, dtype=jnp.int32)
        rows_Sz = rows_S[:, None] + jnp.arange(size, dtype=jnp.int32)  # (S, size)
        start += size
        if comp == "lsh":
            rows_uz = jnp.moveaxis(rows_Sz.reshape(shards, spec.num_buckets, kc), 0, 1)
            rows_uz = rows_uz.reshape(spec.num_buckets, shards * kc)
            out[comp] = _best(jnp.where(earlier_bR, gathered.pos, EMPTY), rows_uz, kc)
        elif comp == "dilated":
            out[comp] = _best(jnp.where(earlier_bR, gathered.pos, EMPTY), rows_Sz.reshape(-1), kc)
        elif comp == "ks":
            rows_z = rows_Sz.reshape(-1)
            ok_bz = earlier_bR[:, rows_z]
            score_bz = jnp.where(ok_bz, gathered.score[:, rows_z], -jnp.inf)
            # Sort by (score descending, position ascending): ties go to the earlier key.
            _, _, row_bz, ok_bz = jax.lax.sort(
                (-score_bz, gathered.pos[:, rows_z], jnp.broadcast_to(rows_z, ok_bz.shape), ok_bz),
                dimension=1,
                num_keys=2,
            )
            out[comp] = jnp.where(ok_bz, row_bz, EMPTY)[:, :kc]
        else:  # sw / sink: index the carried rows by position
            first = offset - kc if comp == "sw" else 0
            slot_bR = jnp.where(earlier_bR, gathered.pos - first, kc)  # kc: dropped
            mine_R = jnp.zeros(gathered.pos.shape[1], bool).at[rows_Sz.reshape(-1)].set(True)
            slot_bR = jnp.where(mine_R, slot_bR, kc)
            table = jnp.full((b, kc), EMPTY, jnp.int32)
            out[comp] = jax.vmap(lambda t, s: t.at[s].set(row_R, mode="drop"))(table, slot_bR)
    return out


def _best(pos_bR, rows_zy, kc):
    """Among rows `rows_zy` (..., y) of pos (b, R), the kc with the largest positions (most
    recent first), as row indices, EMPTY where fewer are valid: (b, ..., kc)."""
    pos_bzy = pos_bR[:, rows_zy]
    top_pos, top_at = jax.lax.top_k(pos_bzy, kc)
    rows = jnp.take_along_axis(jnp.broadcast_to(rows_zy, pos_bzy.shape), top_at, axis=-1)
    return jnp.where(top_pos != EMPTY, rows, EMPTY)


def attend_with_carry(
    q,
    k,
    v,
    key_scores,
    hash_proj,
    gathered: Summary,
    *,
    spec: SparseSpec,
    offset,
    shards,
    q_sum_in,
    k_sum_in,
):
    """o (b, l, e) of the shard at global `offset`: each query's keys over the whole prefix.

    q, k (b, l, n), v (b, l, e), key_scores (b, l) are this shard's; `gathered` every shard's
    `summarise` (rows of shard s at s * R ...), q_sum_in / k_sum_in (b, n) the sums of the
    queries / keys before `offset`. Per component, the kc keys a query selects over the whole
    prefix are the best of its local candidates and the carried ones by the component's rule
    (all carried keys are older than every local key); their union gets one softmax."""
    b, l, _ = q.shape
    kc = spec.keys_per_component
    carried = carried_rows(gathered, offset, shards, spec, l)
    i_l = offset + jnp.arange(l, dtype=jnp.int32)  # global query positions
    s_s = jnp.arange(kc, dtype=jnp.int32)
    parts = []  # (global position, row of [local | gathered], valid), each (b, l, kc')

    def local(j_bls, valid_bls):
        """Local candidates at local positions j."""
        return offset + j_bls, j_bls, valid_bls

    def from_rows(rows_bls):
        """Carried candidates at gathered rows (EMPTY: none)."""
        at = jnp.maximum(rows_bls, 0)
        pos = jnp.take_along_axis(gathered.pos, at.reshape(b, -1), axis=1).reshape(at.shape)
        return pos, l + at, rows_bls != EMPTY

    def by_position(j_ls, valid_ls, rows_bs, first):
        """Arithmetic components: global positions j, local when j >= offset, else carried
        rows indexed by j - first."""
        j_bls = jnp.broadcast_to(j_ls, (b, l, kc))
        carry_at = jnp.clip(j_ls - first, 0, kc - 1)
        pos_c, row_c, ok_c = from_rows(jnp.broadcast_to(rows_bs[:, None, :], (b, l, kc)))
        pos_c, row_c, ok_c = (
            jnp.take_along_axis(x, jnp.broadcast_to(carry_at, (b, l, kc)), axis=2)
            for x in (pos_c, row_c, ok_c)
        )
        is_local = j_bls >= offset
        row = jnp.where(is_local, j_bls - offset, row_c)
        ok = valid_ls & jnp.where(is_local, True, ok_c & (pos_c == j_bls))
        return j_bls, row, ok

    for comp in spec.components:
        if comp == "lsh":
            bucket_q = buckets_after(q, q_sum_in, offset, hash_proj, spec.binning)
            bucket_k = buckets_after(k, k_sum_in, offset, hash_proj, spec.binning)
            pos_l, row_l, ok_l = local(*_lsh_indices(bucket_q, bucket_k, kc))
            # The query's bucket row of the carried table, taken after its m local matches.
            rows_bls = jnp.take_along_axis(carried["lsh"], bucket_q[..., None], axis=1)
            m_bl = jnp.sum(ok_l, axis=-1, keepdims=True)
            pos_c, row_c, ok_c = from_rows(rows_bls)
            parts += [(pos_l, row_l, ok_l), (pos_c, row_c, ok_c & (s_s < kc - m_bl))]
        elif comp == "ks":
            pos_l, row_l, ok_l = local(*_ks_indices(key_scores, kc))
            pos_c, row_c, ok_c = from_rows(jnp.broadcast_to(carried["ks"][:, None], (b, l, kc)))
            score_l = jnp.take_along_axis(
                jax.lax.stop_gradient(key_scores.astype(jnp.float32)),
                jnp.maximum(row_l, 0).reshape(b, -1),
                axis=1,
            ).reshape(b, l, kc)
            score_c = jnp.take_along_axis(
                gathered.score, jnp.maximum(row_c - l, 0).reshape(b, -1), axis=1
            ).reshape(b, l, kc)
            # Carried keys first: lax.top_k gives ties to the lower index, the earlier key.
            score = jnp.concatenate(
                [jnp.where(ok_c, score_c, -jnp.inf), jnp.where(ok_l, score_l, -jnp.inf)], axis=-1
            )
            top, at = jax.lax.top_k(score, kc)
            pos, row = (
                jnp.take_along_axis(jnp.concatenate(pair, -1), at, -1)
                for pair in ((pos_c, pos_l), (row_c, row_l))
            )
            parts.append((pos, row, top > -jnp.inf))
        elif comp == "sw":
            j_ls = i_l[:, None] - s_s
            parts.append(by_position(j_ls, j_ls >= 0, carried["sw"], offset - kc))
        elif comp == "sink":
            j_ls = jnp.broadcast_to(s_s, (l, kc))
            parts.append(by_position(j_ls, j_ls <= i_l[:, None], carried["sink"], 0))
        elif comp == "dilated":
            d = spec.dilation
            j_ls = ((i_l[:, None] + 1) // d) * d - 1 - d * s_s
            # Carried dilated rows are most recent first: row s' holds last_before - d s'.
            last_before = (offset // d) * d - 1
            parts.append(
                _dilated(j_ls, last_before, d, offset, carried["dilated"], from_rows, b, l, kc)
            )
        else:
            raise ValueError(f"component {comp!r} has no carried form (pattern {spec.pattern!r})")
    pos = jnp.concatenate([p[0] for p in parts], axis=-1)
    row = jnp.concatenate([p[1] for p in parts], axis=-1)
    ok = jnp.concatenate([p[2] for p in parts], axis=-1)
    row, ok = dedupe_rows(pos, row, ok)
    k_all = jnp.concatenate([k, gathered.k.astype(k.dtype)], axis=1).astype(jnp.float32)
    v_all = jnp.concatenate([v, gathered.v.astype(v.dtype)], axis=1).astype(jnp.float32)
    block = query_block_size(l, row.shape[-1], k.shape[-1], v.shape[-1])
    o = attend_blocked(q.astype(jnp.float32), k_all, v_all, row, ok, min(block, l))
    return o.astype(v.dtype)


def _dilated(j_ls, last_before, d, offset, carried_bs, from_rows, b, l, kc):
    """Dilated candidates: local when j >= offset, else the carried row (last_before - j) / d."""
    j_bls = jnp.broadcast_to(j_ls, (b, l, kc))
    s_ls = jnp.clip((last_before - j_ls) // d, 0, kc - 1)
    pos_c, row_c, ok_c = from_rows(
        jnp.take_along_axis(
            jnp.broadcast_to(carried_bs[:, None, :], (b, l, kc)),
            jnp.broadcast_to(s_ls, (b, l, kc)),
            axis=2,
        )
    )
    is_local = j_bls >= offset
    row = jnp.where(is_local, j_bls - offset, row_c)
    ok = (j_bls >= 0) & jnp.where(is_local, True, ok_c & (pos_c == j_bls))
    return j_bls, row, ok


def dedupe_rows(pos_bls, row_bls, ok_bls):
    """Rows of each query's candidates (the last axis) in position order, with repeated positions
    (a key picked by two components) and invalid slots masked (row 0, not ok)."""
    sentinel = jnp.iinfo(jnp.int32).max
    pos_bls, row_bls = jax.lax.sort(
        (jnp.where(ok_bls, pos_bls, sentinel), row_bls), dimension=pos_bls.ndim - 1, num_keys=1
    )
    repeat = jnp.concatenate(
        [jnp.zeros_like(pos_bls[..., :1], bool), pos_bls[..., 1:] == pos_bls[..., :-1]], axis=-1
    )
    ok_bls = (pos_bls != sentinel) & ~repeat
    return jnp.where(ok_bls, row_bls, 0), ok_bls


def full_attention_after(q, k_all, v_all, offset):
    """Dense causal attention of queries q (b, l, n) at global positions offset.. over every
    key k_all, v_all (b, L, .) of the sequence (the quadratic ceiling; fp32, out in v.dtype)."""
    q_bin, k_bjn, v_bje = (x.astype(jnp.float32) for x in (q, k_all, v_all))
    scores_bij = jnp.einsum("bin,bjn->bij", q_bin, k_bjn)
    i_l = offset + jnp.arange(q.shape[1])
    causal_ij = jnp.arange(k_all.shape[1])[None, :] <= i_l[:, None]
    probs_bij = jax.nn.softmax(jnp.where(causal_ij, scores_bij, -jnp.inf), axis=-1)
    return jnp.einsum("bij,bje->bie", probs_bij, v_bje).astype(v_all.dtype)
