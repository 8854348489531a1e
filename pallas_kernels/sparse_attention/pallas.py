"""HAX sparse attention by the Pallas kernels (impl="pallas", patterns lsh, ks, lsh+ks): the
inputs padded into the kernels' layouts, their parts summed back by position.

forward:  the lsh pass walks the (bucket, position) order (q, k sorted here: n is small; v
          read and o written by position in the kernel); the ks pass continues its online
          softmax, masking keys the lsh set holds (a key chosen twice counts once) -> o, lse
backward: delta = rowsum(dO o); lsh dq, dk parts (n wide) summed per block / tile and
          un-permuted, lsh dv by position; ks gradients, the prefix parts scatter-added by
          position. No gradient reaches hash_proj or key_scores (the selection is discrete),
          as in the indexed path.
Same contract as `indexed.sparse_attention_indexed`; the queries may also be the last lq of lk
keys (tiling.py). Letters: b batch, l length, L padded length (Lq of the queries, Lk of the
keys), n key dim, e value dim, c query block, j prefix slot.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import launch
from .reference import running_buckets
from .spec import selected
from .tiling import EMPTY_POS, KsLayout, LshLayout, Schedule, ks_layout, lsh_layout, tile_schedule

SUPPORTED_PATTERNS = ("lsh", "ks", "lsh+ks")
F32 = jnp.float32


class Layout(NamedTuple):
    """The selection in the kernels' terms; None for an absent component."""

    lsh: LshLayout | None
    schedule: Schedule | None
    ks: KsLayout | None


def _pow2(x, minimum=16):
    """The next power of two >= max(x, minimum) (Triton block dims; tl.dot needs >= 16)."""
    return max(minimum, 1 << max(0, (x - 1).bit_length()))


def effective_blocks(blocks, e):
    """blocks with block_e capped at the padded value width."""
    return blocks.__class__(**{**blocks.__dict__, "block_e": min(blocks.block_e, _pow2(e))})


def padded_length(l, blocks):
    """l rounded up to a whole number of query blocks and key tiles."""
    step = max(blocks.block_q, blocks.block_k)
    return -(-l // step) * step


def build_layout(q, k, *, spec, hash_proj, key_scores, blocks):
    """The Layout of q, k (b, l, n) for the components of `spec` (O(l log l), plain JAX)."""
    if not spec.has("lsh"):
        return layout_of(None, key_scores, spec=spec, blocks=blocks, n_buckets=0)
    buckets = tuple(running_buckets(x, hash_proj, spec.binning) for x in (q, k))
    return layout_of(buckets, key_scores, spec=spec, blocks=blocks, n_buckets=spec.num_buckets)


def layout_of(buckets, key_scores, *, spec, blocks, n_buckets, n_queries=None):
    """The Layout of given LSH buckets (bucket_q (b, lq), bucket_k (b, lk)) in [0, n_buckets)
    (None without lsh) and key scores (b, lk) (None without ks). The lq = n_queries queries
    (default: every key) are the last lq of the lk key positions, lk - lq a multiple of
    max(block_q, block_k)."""
    lk = (key_scores if buckets is None else buckets[1]).shape[1]
    lq = lk if n_queries is None else n_queries
    first = lk - lq
    if buckets is not None and buckets[0].shape[1] != lq:
        raise ValueError(f"bucket_q must hold n_queries = {lq} queries, got {buckets[0].shape}")
    if first < 0 or first % max(blocks.block_q, blocks.block_k):
        raise ValueError(
            f"the keys before the first query ({first} = {lk} keys - {lq} queries) must be a "
            f"nonnegative multiple of max(block_q, block_k) = "
            f"{max(blocks.block_q, blocks.block_k)}"
        )
    k_length = padded_length(lk, blocks)
    kc = spec.keys_per_component
    lsh = schedule = ks = None
    if spec.has("lsh"):
        lsh = lsh_layout(*buckets, kc, k_length - first, k_length, n_buckets)
        schedule = tile_schedule(lsh.lo, lsh.hi, blocks.block_q, blocks.block_k, kc, k_length)
    if spec.has("ks"):
        ks = ks_layout(key_scores, kc, blocks.block_q, k_length, first)
    return selected(Layout(lsh, schedule, ks))


def _pad(x, length, width):
    """(b, l, f) zero-padded to (b, length, width)."""
    return jnp.pad(x, [(0, 0), (0, length - x.shape[1]), (0, width - x.shape[2])])


def _rows(x_bLf, index_bz):
    """x[b, index[b, ...]]: rows of x gathered per batch."""
    return jax.vmap(lambda x, i: x[i])(x_bLf, index_bz)


def _ks_args(kp, vp, lay, kc):
    """The ks kernels' candidate arrays: prefix k, v (b, nblocks, kcp, .); prefix ints
    (position, bucket, sorted slot) and scores; the blocks' own keys' ints (bucket, slot) and
    scores; per query ints (threshold position, bucket, hi - kc) and threshold score. The
    (padded) queries, one threshold each, are the last of the keys."""
    ks, lsh = lay.ks, lay.lsh
    b, length, _ = kp.shape
    n_queries = ks.threshold_pos.shape[1]
    first = length - n_queries
    nblocks, kcp = ks.prefix_pos.shape[1], _pow2(kc)
    slot_pad = [(0, 0), (0, 0), (0, kcp - kc)]
    pos_bcj = jnp.pad(ks.prefix_pos, slot_pad, constant_values=EMPTY_POS)
    score_bcj = jnp.pad(ks.prefix_scores, slot_pad, constant_values=-jnp.inf)
    at_bcj = jnp.minimum(pos_bcj, length - 1)
    if lsh is None:  # no lsh set: hi - kc past every slot masks nothing
        bucket_k = slot = jnp.zeros((b, length), jnp.int32)
        bucket_q = jnp.zeros((b, n_queries), jnp.int32)
        floor = jnp.full((b, n_queries), EMPTY_POS, jnp.int32)
    else:
        bucket_k, slot, bucket_q = lsh.bucket_k, lsh.key_slot, lsh.bucket_q
        floor = lsh.hi_by_pos - kc
    pre_ints = jnp.stack([pos_bcj, _rows(bucket_k, at_bcj), _rows(slot, at_bcj)], axis=2)
    own_ints = jnp.stack([bucket_k[:, first:], slot[:, first:]], axis=1)
    own_ints = own_ints.reshape(b, 2, nblocks, -1)
    return (
        _rows(kp, at_bcj),
        _rows(vp, at_bcj),
        pre_ints,
        score_bcj[:, :, None, :],
        jnp.moveaxis(own_ints, 2, 1),
        ks.scores[:, first:].reshape(b, nblocks, 1, -1),
        jnp.stack([ks.threshold_pos, bucket_q, floor], axis=-1),
        ks.threshold_score[..., None],
    )


def _padded_inputs(q, k, v, blocks):
    """q, k, v zero-padded to (b, Lq, n'), (b, Lk, n'), (b, Lk, e')."""
    n_pad, e_pad = _pow2(q.shape[2]), -(-v.shape[2] // blocks.block_e) * blocks.block_e
    q_length = padded_length(q.shape[1], blocks)
    k_length = padded_length(k.shape[1], blocks)
    return _pad(q, q_length, n_pad), _pad(k, k_length, n_pad), _pad(v, k_length, e_pad)


def forward(q, k, v, lay, *, kc, cfg):
    """(o (b, lq, e) fp32, lse (b, Lq, 1) fp32 over the union of the selected keys); the lq
    queries are the last of the lk keys. o stays fp32 so that the backward's delta = rowsum(dO
    o) is the fp32 softmax's (a bf16 o would give a query with one selected key a nonzero dq)."""
    l = q.shape[1]
    qp, kp, vp = _padded_inputs(q, k, v, cfg[0])
    init = None
    if lay.lsh is not None:
        lsh = lay.lsh
        q_s, k_s = _rows(qp, lsh.query_perm), _rows(kp, lsh.key_perm)
        init = launch.lsh_forward(
            q_s, k_s, vp, lsh.lo[..., None], lsh.hi[..., None], lsh, lay.schedule, cfg=cfg
        )
    if lay.ks is not None:
        args = _ks_args(kp, vp, lay, kc)
        o, lse = launch.ks_forward(qp, kp, vp, args, init, out_dtype=F32, cfg=cfg)
    else:
        o, lse = init
    return o[:, :l, : v.shape[2]], lse


def _segment_sum(parts_bsrf, index_bs, nblocks):
    """Sum the (rows, f) parts of the pairs into their blocks: (b, nblocks * rows, f)."""
    b, _, rows, f = parts_bsrf.shape

    def add(parts, index):
        """One batch row."""
        return jnp.zeros((nblocks, rows, f), F32).at[index].add(parts)

    return jax.vmap(add)(parts_bsrf, index_bs).reshape(b, nblocks * rows, f)


def _scatter_add(x_bLf, parts_bcjf, pos_bcj):
    """x plus the prefix parts added at their positions (empty slots dropped)."""
    f = parts_bcjf.shape[-1]

    def add(x, parts, pos):
        """One batch row."""
        return x.at[pos.ravel()].add(parts.reshape(-1, f), mode="drop")

    return jax.vmap(add)(x_bLf, parts_bcjf, pos_bcj)


def backward(q, k, v, lay, o, lse, do, *, kc, cfg):
    """Gradients (dq, dk, dv) in the inputs' dtypes, given o and lse from `forward`."""
    lq, n = q.shape[1:]
    lk, e = v.shape[1:]
    qp, kp, vp = _padded_inputs(q, k, v, cfg[0])
    q_length, (k_length, e_pad) = qp.shape[1], vp.shape[1:]
    first = k_length - q_length
    do_p, o_p = _pad(do.astype(v.dtype), q_length, e_pad), _pad(o, q_length, e_pad)
    delta = jnp.sum(do_p.astype(F32) * o_p.astype(F32), axis=-1, keepdims=True)
    dq = jnp.zeros(qp.shape, F32)
    dk = jnp.zeros(kp.shape, F32)
    dv = jnp.zeros(vp.shape, F32)
    if lay.lsh is not None:
        lsh = lay.lsh
        qperm, kperm = lsh.query_perm, lsh.key_perm
        dq_parts, dk_parts, dv_lsh = launch.lsh_backward(
            _rows(qp, qperm),
            _rows(kp, kperm),
            vp,
            lsh.lo[..., None],
            lsh.hi[..., None],
            _rows(lse, qperm),
            _rows(delta, qperm),
            do_p,
            lsh,
            lay.schedule,
            cfg=cfg,
        )
        sched, blocks = lay.schedule, cfg[0]
        dq_s = _segment_sum(dq_parts, sched.pair_block, q_length // blocks.block_q)
        dk_s = _segment_sum(dk_parts, sched.pair_tile, k_length // blocks.block_k)
        dq += _rows(dq_s, lsh.query_rank)
        dk += _rows(dk_s, lsh.key_slot)
        dv += dv_lsh
    if lay.ks is not None:
        # After lsh, the ks kernel adds its own keys' dv into lsh's in place.
        dv_in = dv if lay.lsh is not None else None
        dq_ks, dk_own, dv_ks, dk_pre, dv_pre = launch.ks_backward(
            qp, kp, vp, _ks_args(kp, vp, lay, kc), lse, delta, do_p, cfg=cfg, dv_in=dv_in
        )
        pos = jnp.pad(
            lay.ks.prefix_pos,
            [(0, 0), (0, 0), (0, dk_pre.shape[2] - kc)],
            constant_values=EMPTY_POS,
        )
        dq += dq_ks
        dk = _scatter_add(dk.at[:, first:].add(dk_own), dk_pre, pos)
        dv = dv_ks if dv_in is not None else dv.at[:, first:].add(dv_ks)
        dv = _scatter_add(dv, dv_pre, pos)
    return (
        dq[:, :lq, :n].astype(q.dtype),
        dk[:, :lk, :n].astype(k.dtype),
        dv[:, :lk, :e].astype(v.dtype),
    )
