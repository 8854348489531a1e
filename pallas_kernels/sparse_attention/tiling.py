"""Tiling of the Pallas sparse attention: the block sizes, the block layout (which key tiles a
block of queries visits) and the access to rows chosen at run time.

Layout (plain JAX, O(l log l), no (l, l) array). LSH: keys and queries sorted by (bucket,
position). Query i's lsh set is the run of sorted-key slots [lo_i, hi_i): hi_i counts the keys
at or before it in that order (its insertion point), lo_i = max(hi_i - kc, first slot of its
bucket). Both are nondecreasing along the sorted
queries, so a block of consecutive sorted queries needs only the few key tiles that
`tile_schedule` lists (pairs (query block, key tile), block-major, and their transpose).

KS: the top-kc of key_scores[0..i] (ties to the earlier position) lies in the running top-kc of
the keys before i's block (an associative scan of per-block top-k) plus the block's own keys;
query i selects a causal candidate iff it is at least as good as its threshold, the worst
member of its set. A key scored -inf is never selected (padding; the empty rows of a sequence
shard's carried keys, carry_pallas.py): where fewer than kc finite keys precede a query, its
threshold (-inf, position -1) admits exactly the finite ones.

Queries may be fewer than keys: the lq queries are then the last lq key positions (a sequence
shard's queries after the earlier shards' carried keys, carry_pallas.py), and nothing is computed
for the keys before them. Letters: b batch, l length, L padded length (Lq of the queries, Lk of
the keys), m merged keys + queries, c query block, r row in a block, t key tile, s scheduled
pair, j slot of a top-k.

Row access: rows chosen at run time, for both kernel variants: "gpu" (Triton) indexes the whole
array through pointers; "tpu" (Mosaic, whose blocks cannot follow data) copies the rows between HBM
and VMEM by DMA and keeps schedules and index arrays in SMEM. `Specs` gives each variant's
block specs at the call site, `Loader` the matching reads and writes inside a kernel.
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiles: block_q queries per block, block_k sorted keys per lsh tile, block_e value columns
    per program (powers of two >= 16); num_warps / num_stages for Triton."""

    block_q: int = 64
    block_k: int = 64
    block_e: int = 128
    num_warps: int = 4
    num_stages: int = 2


# ---------------------------------------------------------------- layout

# Position of an empty top-k slot: after every query, so never causal.
EMPTY_POS = 2**30


class LshLayout(NamedTuple):
    """The (bucket, position) order; padding rows map to themselves and select nothing. Keys
    are indexed by position (Lk of them), queries by their index (Lq; query i sits at key
    position Lk - Lq + i)."""

    key_perm: jax.Array  # (b, Lk) position of the key at each sorted slot
    key_slot: jax.Array  # (b, Lk) sorted slot of the key at each position (inverse)
    query_perm: jax.Array  # (b, Lq) index of the query at each sorted index
    query_rank: jax.Array  # (b, Lq) sorted index of each query (inverse)
    lo: jax.Array  # (b, Lq) first slot of each sorted query's lsh set
    hi: jax.Array  # (b, Lq) one past its last slot (the insertion point)
    hi_by_pos: jax.Array  # (b, Lq) hi of each query, by index
    bucket_q: jax.Array  # (b, Lq) query buckets by index (padding -1)
    bucket_k: jax.Array  # (b, Lk) key buckets by position (padding -1)


class Schedule(NamedTuple):
    """Scheduled (query block, key tile) pairs; entries past pair_count are padding."""

    block_offset: jax.Array  # (b, nblocks) first pair of each query block (block-major order)
    block_count: jax.Array  # (b, nblocks)
    pair_block: jax.Array  # (b, S) query block of each pair, block-major
    pair_tile: jax.Array  # (b, S) key tile of each pair, block-major
    tile_offset: jax.Array  # (b, ntiles) first pair of each key tile (tile-major order)
    tile_count: jax.Array  # (b, ntiles)
    tile_block: jax.Array  # (b, S) query block of each pair, tile-major
    pair_count: jax.Array  # (b,)


class KsLayout(NamedTuple):
    """Per query block the running top-kc before it; per query its threshold."""

    scores: jax.Array  # (b, Lk) fp32 key scores by position, padding -inf
    prefix_pos: jax.Array  # (b, nblocks, kc) positions, EMPTY_POS where fewer keys came before
    prefix_scores: jax.Array  # (b, nblocks, kc) their scores (-inf where empty)
    threshold_score: jax.Array  # (b, Lq) worst member's score; +inf for padding queries
    threshold_pos: jax.Array  # (b, Lq) worst member's position; -1 for padding queries and
    # where the worst is -inf (no -inf key is selected)


def _sort_by_bucket(bucket_m, order_m, n_buckets, order_bound):
    """Sort (bucket, order) pairs by bucket then order (distinct orders < order_bound). Packed
    into one int32 key when it fits: a single-array sort is a radix sort on GPU."""
    bits = max(1, (order_bound - 1).bit_length())
    if n_buckets << bits <= 2**31:
        packed = jnp.sort((bucket_m << bits) | order_m)
        return packed >> bits, packed & ((1 << bits) - 1)
    return jax.lax.sort((bucket_m, order_m), num_keys=2)


def _lsh_order(bucket_q_l, bucket_k_l, kc, q_length, k_length, n_buckets):
    """LshLayout fields of one batch row (see `lsh_layout`)."""
    lq, lk = bucket_q_l.shape[0], bucket_k_l.shape[0]
    first = lk - lq  # the position of query 0 among the keys
    key_pos = jnp.arange(lk, dtype=jnp.int32)
    query_pos = first + jnp.arange(lq, dtype=jnp.int32)
    # Key j sorts just before query j (order 2j vs 2j + 1), as in indexed._lsh_indices.
    bucket_m, order_m = _sort_by_bucket(
        jnp.concatenate([bucket_k_l, bucket_q_l]),
        jnp.concatenate([2 * key_pos, 2 * query_pos + 1]),
        n_buckets,
        2 * lk,
    )
    is_key_m = order_m % 2 == 0
    src_m = order_m // 2 - jnp.where(is_key_m, 0, first)  # key position, or query index
    hi_m = jnp.cumsum(is_key_m, dtype=jnp.int32)  # keys sorted at or before each entry
    run_start_m = jnp.concatenate([jnp.ones(1, bool), bucket_m[1:] != bucket_m[:-1]])
    bucket_first_m = jax.lax.cummax(jnp.where(run_start_m, hi_m - is_key_m, 0))
    lo_m = jnp.maximum(hi_m - kc, bucket_first_m)
    index_m = jnp.arange(lk + lq, dtype=jnp.int32)
    key_slot_m = jnp.where(is_key_m, hi_m - 1, k_length)  # out of range: dropped
    query_index_m = jnp.where(is_key_m, q_length, index_m - hi_m)
    keys, queries = jnp.arange(k_length, dtype=jnp.int32), jnp.arange(q_length, dtype=jnp.int32)
    key_perm = keys.at[key_slot_m].set(src_m, mode="drop")
    query_perm = queries.at[query_index_m].set(src_m, mode="drop")
    lo = jnp.full(q_length, lk, jnp.int32).at[query_index_m].set(lo_m, mode="drop")
    hi = jnp.full(q_length, lk, jnp.int32).at[query_index_m].set(hi_m, mode="drop")
    key_slot = jnp.zeros(k_length, jnp.int32).at[key_perm].set(keys)
    query_rank = jnp.zeros(q_length, jnp.int32).at[query_perm].set(queries)
    hi_by_pos = jnp.zeros(q_length, jnp.int32).at[query_perm].set(hi)
    return key_perm, key_slot, query_perm, query_rank, lo, hi, hi_by_pos


def lsh_layout(bucket_q_bl, bucket_k_bl, kc, q_length, k_length, n_buckets):
    """The sorted order of keys and queries and each sorted query's lsh slots [lo, hi); buckets
    in [0, n_buckets). The lq queries are the last lq of the lk key positions (lq = lk: every
    position is both); the query fields are padded to q_length, the key fields to k_length."""
    fields = jax.vmap(lambda q, k: _lsh_order(q, k, kc, q_length, k_length, n_buckets))(
        bucket_q_bl, bucket_k_bl
    )
    buckets = [
        jnp.pad(x, [(0, 0), (0, length - x.shape[1])], constant_values=-1)
        for x, length in ((bucket_q_bl, q_length), (bucket_k_bl, k_length))
    ]
    return LshLayout(*fields, *buckets)


def tile_schedule(lo_bL, hi_bL, block_q, block_k, kc, k_length):
    """The key tiles (of block_k of the k_length sorted slots) that each block of block_q sorted
    queries needs, given nondecreasing lsh slot ranges [lo, hi) of width <= kc.

    Each query adds the tiles of its range past the last tile of the earlier queries of its
    block: a tile never repeats within a block and no tile outside the union is listed. A
    query's range spans at most tmax = (kc - 1) // block_k + 2 tiles and ranges advance
    monotonically, so there are at most ntiles + nblocks * tmax pairs (the static size S).
    """
    b, length = lo_bL.shape
    nblocks, ntiles = length // block_q, k_length // block_k
    tmax = (kc - 1) // block_k + 2
    size = ntiles + nblocks * tmax
    nonempty = hi_bL > lo_bL
    first = lo_bL // block_k
    last = jnp.where(nonempty, (hi_bL - 1) // block_k, -1)
    seen_bcr = jax.lax.cummax(last.reshape(b, nblocks, block_q), axis=2)
    seen_bcr = jnp.pad(seen_bcr[:, :, :-1], [(0, 0), (0, 0), (1, 0)], constant_values=-1)
    start = jnp.maximum(first, seen_bcr.reshape(b, length) + 1)
    count = jnp.where(nonempty, jnp.maximum(last - start + 1, 0), 0)
    offset = jnp.cumsum(count, axis=1) - count
    step_j = jnp.arange(tmax, dtype=jnp.int32)
    index_bLj = jnp.where(step_j < count[..., None], offset[..., None] + step_j, size)
    tile_bLj = start[..., None] + step_j
    block_bLj = jnp.broadcast_to((jnp.arange(length) // block_q)[:, None], (length, tmax))

    def scatter(index_Lj, value_Lj):
        """Place the pairs of one batch row (padding -> 0)."""
        return jnp.zeros(size, jnp.int32).at[index_Lj.ravel()].set(value_Lj.ravel(), mode="drop")

    pair_tile = jax.vmap(scatter)(index_bLj, tile_bLj)
    pair_block = jax.vmap(scatter, (0, None))(index_bLj, block_bLj.astype(jnp.int32))
    pair_count = jnp.sum(count, axis=1, dtype=jnp.int32)
    # The transpose: pairs sorted by (tile, block), padding (tile = ntiles) last.
    real_bs = jnp.arange(size) < pair_count[:, None]
    tile_key = jnp.where(real_bs, pair_tile, ntiles)
    _, tile_block = jax.lax.sort((tile_key, pair_block), dimension=1, num_keys=2)
    tile_count = jax.vmap(lambda t: jnp.zeros(ntiles + 1, jnp.int32).at[t].add(1))(tile_key)
    tile_count = tile_count[:, :ntiles]
    return Schedule(
        block_offset=offset[:, ::block_q],
        block_count=count.reshape(b, nblocks, block_q).sum(-1, dtype=jnp.int32),
        pair_block=pair_block,
        pair_tile=pair_tile,
        tile_offset=jnp.cumsum(tile_count, axis=1) - tile_count,
        tile_count=tile_count,
        tile_block=tile_block,
        pair_count=pair_count,
    )


def _top(scores_zw, pos_zw, kc):
    """The kc best (score, position) of each row, best first; rows must be ordered so that
    equal scores appear in increasing position (lax.top_k keeps the lower index first)."""
    top_zj, index_zj = jax.lax.top_k(scores_zw, kc)
    return top_zj, jnp.take_along_axis(pos_zw, index_zj, axis=-1)


def ks_layout(key_scores_bl, kc, block_q, length, first_query=0):
    """Running top-kc before every query block (parallel prefix over blocks) and each query's
    threshold (the kc-th best of [0..i], or the worst when fewer keys came before), for the
    queries at key positions first_query.. (a multiple of block_q) of the keys padded to
    `length`."""
    b, l = key_scores_bl.shape
    nblocks = length // block_q
    scores_bL = jax.lax.stop_gradient(key_scores_bl.astype(jnp.float32))
    scores_bL = jnp.pad(scores_bL, [(0, 0), (0, length - l)], constant_values=-jnp.inf)
    pos_L = jnp.arange(length, dtype=jnp.int32)
    scores_bcr = scores_bL.reshape(b, nblocks, block_q)
    pos_bcr = jnp.broadcast_to(pos_L.reshape(nblocks, block_q), (b, nblocks, block_q))
    width_pad = [(0, 0), (0, 0), (0, max(0, kc - block_q))]
    own = _top(
        jnp.pad(scores_bcr, width_pad, constant_values=-jnp.inf),
        jnp.pad(pos_bcr, width_pad, constant_values=EMPTY_POS),
        kc,
    )

    def merge(earlier, later):
        """Top-kc of two top-kc sets, the earlier positions first (ties to them)."""
        return _top(*(jnp.concatenate([x, y], -1) for x, y in zip(earlier, later)), kc)

    run_s, run_p = jax.lax.associative_scan(merge, own, axis=1)
    shift = [(0, 0), (1, 0), (0, 0)]
    # From here on only the query blocks: the keys before first_query are no queries.
    first_block = first_query // block_q
    nq = nblocks - first_block
    prefix_s = jnp.pad(run_s[:, :-1], shift, constant_values=-jnp.inf)[:, first_block:]
    prefix_p = jnp.pad(run_p[:, :-1], shift, constant_values=EMPTY_POS)[:, first_block:]
    scores_bcr = scores_bcr[:, first_block:]
    # Candidates of row r: the prefix (earlier positions) then the block's keys up to r.
    r_r = jnp.arange(block_q)
    causal_rr = r_r[None, :] <= r_r[:, None]
    cand_bcrw = jnp.concatenate(
        [
            jnp.broadcast_to(prefix_s[:, :, None, :], (b, nq, block_q, kc)),
            jnp.where(causal_rr, scores_bcr[:, :, None, :], -jnp.inf),
        ],
        axis=-1,
    )
    top_bcrj, index_bcrj = jax.lax.top_k(cand_bcrw, kc)
    # The worst member: slot min(kc, #causal candidates) - 1 of the sorted top-kc.
    start_c = (first_block + jnp.arange(nq, dtype=jnp.int32)) * block_q
    n_causal_cr = jnp.minimum(kc, start_c)[:, None] + r_r[None, :] + 1
    worst_bcr1 = jnp.broadcast_to(jnp.minimum(kc, n_causal_cr)[..., None] - 1, (b, nq, block_q, 1))
    threshold_score = jnp.take_along_axis(top_bcrj, worst_bcr1, -1).reshape(b, nq * block_q)
    index_bcr = jnp.take_along_axis(index_bcrj, worst_bcr1, -1)[..., 0]
    from_prefix = jnp.take_along_axis(prefix_p, jnp.minimum(index_bcr, kc - 1), -1)
    from_block = start_c[:, None] + index_bcr - kc
    threshold_pos = jnp.where(index_bcr < kc, from_prefix, from_block).reshape(b, nq * block_q)
    threshold_pos = jnp.where(threshold_score > -jnp.inf, threshold_pos, -1)
    real = pos_L[first_block * block_q :] < l
    return KsLayout(
        scores=scores_bL,
        prefix_pos=prefix_p,
        prefix_scores=prefix_s,
        threshold_score=jnp.where(real, threshold_score, jnp.inf),
        threshold_pos=jnp.where(real, threshold_pos, -1).astype(jnp.int32),
    )


# ---------------------------------------------------------------- row access


class Specs:
    """Block specs of one variant; every grid starts with the batch axis."""

    def __init__(self, variant):
        self.variant = variant

    @staticmethod
    def rows(rows, width, index):
        """(b, L, f) array: the (rows, width) block at (row block, col block) = index(*grid)."""
        return pl.BlockSpec((None, rows, width), lambda b, *g: (b, *index(*g)))

    @staticmethod
    def slab(shape, index):
        """(b, nblocks, h, w) array: the (h, w) block at (block, 0, col block) = index(*grid)."""
        return pl.BlockSpec((None, None, *shape), lambda b, *g: (b, *index(*g)))

    def whole(self, x):
        """An array (or output) used at run-time rows (3-d) or read as scalars and index rows
        (schedules and orders, 1-d / 2-d)."""
        if self.variant == "tpu":
            return pl.BlockSpec(memory_space=pl.ANY if x.ndim == 3 else pltpu.SMEM)
        if x.ndim == 3:
            return pl.BlockSpec((None, *x.shape[1:]), lambda b, *g: (b, 0, 0))
        return pl.BlockSpec(x.shape, lambda *g: (0,) * x.ndim)

    def scratch(self, slots):
        """tpu: a VMEM buffer per Loader slot (name, shape, dtype), then a DMA semaphore."""
        if self.variant != "tpu":
            return []
        return [pltpu.VMEM(shape, dtype) for _, shape, dtype in slots] + [pltpu.SemaphoreType.DMA]


class Loader:
    """Rows, chosen at run time, of (b, rows, f) arrays the kernel sees whole: a run of rows
    (`__call__`) or the rows an index array lists (`gather`, `scatter`: the lsh kernels read
    and write values in position order while walking the sorted order). gpu: Triton pointer
    arithmetic on the whole-array ref; tpu: DMAs between HBM and the VMEM buffer of the named
    slot (scratch holds one buffer per slot, in `slots` order, then a DMA semaphore)."""

    def __init__(self, slots, scratch):
        self.bufs = dict(zip(slots, scratch[:-1])) if scratch else None
        self.sem = scratch[-1] if scratch else None
        # Read at the kernel's top level: interpret mode cannot see program_id in a cond.
        self.b = pl.program_id(0)

    def __call__(self, slot, ref, start, size, cols):
        """Rows [start, start + size) and columns `cols` (a pl.ds) of this batch row."""
        if self.bufs is None:
            return ref[pl.ds(start, size), cols]
        buf = self.bufs[slot]
        copy = pltpu.make_async_copy(ref.at[self.b, pl.ds(start, size), cols], buf, self.sem)
        copy.start()
        copy.wait()
        return buf[...]

    def gather(self, slot, ref, index_ref, start, size, cols):
        """Rows index[b, start:start + size] of ref, columns `cols`."""
        b = self.b
        if self.bufs is None:
            return ref[index_ref[b, pl.ds(start, size)], cols]
        buf = self.bufs[slot]

        def copy(r):
            """Row r of the buffer from its source row."""
            row = ref.at[b, pl.ds(index_ref[b, start + r], 1), cols]
            return pltpu.make_async_copy(row, buf.at[pl.ds(r, 1)], self.sem)

        self._each_row(size, copy)
        return buf[...]

    def scatter(self, slot, ref, index_ref, start, cols, value):
        """ref[b, index[b, start:start + rows], cols] = value."""
        b = self.b
        if self.bufs is None:
            ref[index_ref[b, pl.ds(start, value.shape[0])], cols] = value
            return
        buf = self.bufs[slot]
        buf[...] = value

        def copy(r):
            """Row r of the buffer to its destination row."""
            row = ref.at[b, pl.ds(index_ref[b, start + r], 1), cols]
            return pltpu.make_async_copy(buf.at[pl.ds(r, 1)], row, self.sem)

        self._each_row(value.shape[0], copy)

    @staticmethod
    def _each_row(size, copy):
        """Start copy(r) for every row r, then wait for all of them."""

        def start(r, carry):
            """Issue row r."""
            copy(r).start()
            return carry

        def wait(r, carry):
            """Wait for row r."""
            copy(r).wait()
            return carry

        jax.lax.fori_loop(0, size, start, 0)
        jax.lax.fori_loop(0, size, wait, 0)


def ks_specs(sp, bq, kcp, n, width, col, first_block=0):
    """Specs of q, k, v, prefix k, prefix v and the six selection arrays of a ks block (v
    columns `width` wide at column block col(*grid)); the block's own keys are key block
    first_block + c of query block c."""
    row = lambda *g: (g[0], 0)  # noqa: E731
    own = lambda *g: (g[0] + first_block, 0)  # noqa: E731
    return [
        sp.rows(bq, n, row),
        sp.rows(bq, n, own),
        sp.rows(bq, width, lambda *g: (g[0] + first_block, col(*g))),
        sp.slab((kcp, n), lambda *g: (g[0], 0, 0)),
        sp.slab((kcp, width), lambda *g: (g[0], 0, col(*g))),
        sp.slab((3, kcp), lambda *g: (g[0], 0, 0)),
        sp.slab((1, kcp), lambda *g: (g[0], 0, 0)),
        sp.slab((2, bq), lambda *g: (g[0], 0, 0)),
        sp.slab((1, bq), lambda *g: (g[0], 0, 0)),
        sp.rows(bq, 3, row),
        sp.rows(bq, 1, row),
    ]
