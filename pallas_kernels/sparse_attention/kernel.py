"""HAX sparse attention (lsh / ks / lsh+ks) in Pallas: flash attention over key tiles that a
block of queries shares, forward and backward; variants "gpu" (Triton) and "tpu" (Mosaic).

  lsh_fwd   per (block of BQ queries in (bucket, position) order, e block): the key tiles of
            its schedule (sorted keys, run-time count), online softmax, fp32 statistics
  ks_fwd    per (block of BQ queries in position order, e block): the running top-kc before
            the block plus its own keys (fixed size) minus the lsh set's keys, continuing from
            the lsh pass's (o, lse) by the flash rule -> o in v.dtype and the final lse
  lsh_pair  backward per scheduled (query block, key tile) pair: dS over the whole e, then the
            n-wide dq and dk parts (summed per block / tile in JAX)
  lsh_dv    backward per (sorted key tile, e block): the query blocks that see it -> dv
  ks_bwd    backward per query block: dq; dk, dv of its own keys; dk, dv parts of its prefix
FlashAttention-2 backward with the final lse: P = exp(s - lse), dS = P (dO.v - delta). Nothing
(l, l) or (l, num_keys, e) is formed; value tiles are read once per (block, tile) pair.

The lsh kernels read v and dO rows by position through the sorted orders and write o and dv
by position, so no permuted copy of an e-wide array is made; run-time rows go through
`tiling.Loader` (Triton pointers on gpu, DMAs and SMEM on tpu). Their pallas_calls are in
launch.py. Letters: b batch, c query block, t key tile, n key dim (padded to >= 16), e value dim
(padded to the e block).
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .tiling import Loader

F32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST


def _dot(a, b, *, trans_a=False, trans_b=False):
    """a @ b (optionally transposed), fp32 accumulation; fp32 operands at full precision (a
    Triton fp32 dot is TF32 by default)."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    precision = HIGHEST if a.dtype == F32 else None
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=F32)


def _online(carry, s, mask, v):
    """Fold one masked score tile s (r, k) with values v (k, e) into (max, denominator, acc)."""
    m, denom, acc = carry
    s = jnp.where(mask, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # all masked so far: keep exp finite
    alpha = jnp.exp(m - m_safe)
    p = jnp.exp(s - m_safe)
    denom = alpha * denom + jnp.sum(p, axis=1, keepdims=True)
    return m_new, denom, alpha * acc + _dot(p.astype(v.dtype), v)


def _finish(m, denom, acc):
    """(normalised output, lse); rows with no selected key give (0, -inf)."""
    some = denom > 0
    lse = jnp.where(some, m + jnp.log(jnp.where(some, denom, 1.0)), -jnp.inf)
    return acc / jnp.where(some, denom, 1.0), lse


def _probs(s, mask, lse):
    """P = exp(s - lse) on the selected entries, exactly 0 elsewhere."""
    return jnp.where(mask, jnp.exp(jnp.where(mask, s - lse, 0.0)), 0.0)


def _ds(p, dp, delta, dtype):
    """dS = P (dO.v - delta), rounded to the inputs' dtype for the dq / dk dots (FlashAttention-2's
    rule): bf16 inputs then use the tensor cores; fp32 inputs keep fp32 at full precision."""
    return (p * (dp - delta)).astype(dtype)


def _lsh_mask(lo, hi, first_slot, size):
    """Sorted key slots first_slot + (0..size) inside each query's [lo, hi) (columns (r, 1))."""
    slot = first_slot + jax.lax.broadcasted_iota(jnp.int32, (1, size), 1)
    return (slot >= lo) & (slot < hi)


def _over_columns(e, block_e, body, carry, unrolled):
    """carry = body(cols, carry) for each block_e-wide column chunk of e: a loop (Triton
    pipelines its loads) or, unrolled, static offsets (Mosaic slices lanes statically)."""
    if unrolled:
        for col in range(0, e, block_e):
            carry = body(pl.ds(col, block_e), carry)
        return carry

    def chunk(j, carry):
        """Chunk j."""
        return body(pl.ds(pl.multiple_of(j * block_e, block_e), block_e), carry)

    return jax.lax.fori_loop(0, e // block_e, chunk, carry)


# ---------------------------------------------------------------- lsh kernels


def lsh_fwd_kernel(
    offset_ref,
    count_ref,
    tile_ref,
    key_perm_ref,
    query_perm_ref,  # schedule, orders
    q_ref,
    lo_ref,
    hi_ref,
    k_ref,
    v_ref,  # inputs (v by position)
    o_ref,
    lse_ref,  # outputs, by position
    *scratch,
    block_k,
    block_e,
    slots,
):
    """One (sorted query block, e block): walk its scheduled key tiles."""
    b, c, col = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    load = Loader(slots, scratch)
    q, lo, hi = q_ref[...], lo_ref[...], hi_ref[...]
    (rows, n), offset = q.shape, offset_ref[b, c]
    cols = pl.ds(col * block_e, block_e)

    def body(step, carry):
        """One key tile into the online softmax."""
        start = tile_ref[b, offset + step] * block_k
        k_t = load("k", k_ref, start, block_k, pl.ds(0, n))
        v_t = load.gather("v", v_ref, key_perm_ref, start, block_k, cols)
        s = _dot(q, k_t, trans_b=True)
        return _online(carry, s, _lsh_mask(lo, hi, start, block_k), v_t)

    init = (jnp.full((rows, 1), -jnp.inf, F32), jnp.zeros((rows, 1), F32))
    init += (jnp.zeros((rows, block_e), F32),)
    o, lse = _finish(*jax.lax.fori_loop(0, count_ref[b, c], body, init))
    load.scatter("o", o_ref, query_perm_ref, c * rows, cols, o)

    @pl.when(col == 0)
    def _():
        """The statistics once per query block."""
        load.scatter("lse", lse_ref, query_perm_ref, c * rows, pl.ds(0, 1), lse)


def lsh_pair_kernel(
    count_ref,
    block_ref,
    tile_ref,
    key_perm_ref,
    query_perm_ref,  # pair list, orders
    q_ref,
    lo_ref,
    hi_ref,
    lse_ref,
    delta_ref,
    do_ref,
    k_ref,
    v_ref,  # (dO, v by position)
    dq_ref,
    dk_ref,  # outputs: this pair's parts
    *scratch,
    block_q,
    block_k,
    block_e,
    slots,
):
    """One scheduled (query block, key tile) pair: dS over the whole e, then dq and dk parts."""
    b, pair = pl.program_id(0), pl.program_id(1)
    load = Loader(slots, scratch)
    n, e = q_ref.shape[-1], do_ref.shape[-1]

    @pl.when(pair < count_ref[b])
    def _():
        """A real pair."""
        q_start = block_ref[b, pair] * block_q
        k_start = tile_ref[b, pair] * block_k
        whole = pl.ds(0, 1)
        q = load("q", q_ref, q_start, block_q, pl.ds(0, n))
        k_t = load("k", k_ref, k_start, block_k, pl.ds(0, n))
        lo = load("lo", lo_ref, q_start, block_q, whole)
        hi = load("hi", hi_ref, q_start, block_q, whole)
        lse = load("lse", lse_ref, q_start, block_q, whole)
        delta = load("delta", delta_ref, q_start, block_q, whole)
        p = _probs(_dot(q, k_t, trans_b=True), _lsh_mask(lo, hi, k_start, block_k), lse)

        def dot_values(cols, dp):
            """dO.v^T over one column chunk (dS needs every value column)."""
            do_c = load.gather("do", do_ref, query_perm_ref, q_start, block_q, cols)
            v_c = load.gather("v", v_ref, key_perm_ref, k_start, block_k, cols)
            return dp + _dot(do_c, v_c, trans_b=True)

        dp = _over_columns(e, block_e, dot_values, jnp.zeros(p.shape, F32), bool(scratch))
        ds = _ds(p, dp, delta, q.dtype)
        dq_ref[...] = _dot(ds, k_t)
        dk_ref[...] = _dot(ds, q, trans_a=True)

    @pl.when(pair >= count_ref[b])
    def _():
        """Padding past the pair count: zero parts."""
        dq_ref[...] = jnp.zeros(dq_ref.shape, F32)
        dk_ref[...] = jnp.zeros(dk_ref.shape, F32)


def lsh_dv_kernel(
    offset_ref,
    count_ref,
    block_ref,
    key_perm_ref,
    query_perm_ref,  # schedule, orders
    k_ref,
    q_ref,
    lo_ref,
    hi_ref,
    lse_ref,
    do_ref,  # this key tile; inputs (dO by position)
    dv_ref,  # output, by position
    *scratch,
    block_q,
    block_e,
    slots,
):
    """One (sorted key tile, e block): dv = sum of P^T dO over the query blocks that see it."""
    b, t, col = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    load = Loader(slots, scratch)
    k_t = k_ref[...]
    block_k, n = k_t.shape
    offset = offset_ref[b, t]
    whole, cols = pl.ds(0, 1), pl.ds(col * block_e, block_e)

    def body(step, acc):
        """One query block's P^T dO."""
        q_start = block_ref[b, offset + step] * block_q
        q = load("q", q_ref, q_start, block_q, pl.ds(0, n))
        lo = load("lo", lo_ref, q_start, block_q, whole)
        hi = load("hi", hi_ref, q_start, block_q, whole)
        lse = load("lse", lse_ref, q_start, block_q, whole)
        do_c = load.gather("do", do_ref, query_perm_ref, q_start, block_q, cols)
        mask = _lsh_mask(lo, hi, t * block_k, block_k)
        p = _probs(_dot(q, k_t, trans_b=True), mask, lse)
        return acc + _dot(p.astype(do_c.dtype), do_c, trans_a=True)

    init = jnp.zeros((block_k, block_e), F32)
    dv = jax.lax.fori_loop(0, count_ref[b, t], body, init)
    load.scatter("dv", dv_ref, key_perm_ref, t * block_k, cols, dv)


# ---------------------------------------------------------------- ks kernels


def _ks_masks(c, pre_ints_ref, pre_score_ref, own_ints_ref, own_score_ref, q_ints_ref, thr_ref):
    """Selected (prefix, own) candidates of the queries at key block c: causal and at least as
    good as the query's threshold, minus the keys its lsh set holds (same bucket, sorted slot
    >= hi - kc; q_ints columns: threshold position, bucket, hi - kc)."""
    rows = thr_ref.shape[0]
    i = c * rows + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    thr_score, thr_pos = thr_ref[...], q_ints_ref[:, 0:1]
    bucket, lsh_floor = q_ints_ref[:, 1:2], q_ints_ref[:, 2:3]

    def select(pos, score, bucket_k, slot):
        """Candidates given as (1, w) rows."""
        member = (pos <= i) & ((score > thr_score) | ((score == thr_score) & (pos <= thr_pos)))
        return member & ~((bucket_k == bucket) & (slot >= lsh_floor))

    own_pos = c * rows + jax.lax.broadcasted_iota(jnp.int32, (1, rows), 1)
    pre = select(
        pre_ints_ref[0:1, :], pre_score_ref[...], pre_ints_ref[1:2, :], pre_ints_ref[2:3, :]
    )
    own = select(own_pos, own_score_ref[...], own_ints_ref[0:1, :], own_ints_ref[1:2, :])
    return pre, own


def ks_fwd_kernel(*refs, has_init, first_block):
    """One (query block, e block): prefix + own candidates, from the lsh state if has_init."""
    q_ref, k_ref, v_ref, pre_k_ref, pre_v_ref = refs[:5]
    meta_refs = refs[5:11]
    init_refs, (o_ref, lse_ref) = refs[11:-2], refs[-2:]
    q = q_ref[...]
    mask_pre, mask_own = _ks_masks(first_block + pl.program_id(1), *meta_refs)
    rows, width = o_ref.shape
    if has_init:
        lse0 = init_refs[1][...]
        carry = (lse0, jnp.where(lse0 > -jnp.inf, 1.0, 0.0), init_refs[0][...])
    else:
        carry = (jnp.full((rows, 1), -jnp.inf, F32), jnp.zeros((rows, 1), F32))
        carry += (jnp.zeros((rows, width), F32),)
    carry = _online(carry, _dot(q, pre_k_ref[...], trans_b=True), mask_pre, pre_v_ref[...])
    carry = _online(carry, _dot(q, k_ref[...], trans_b=True), mask_own, v_ref[...])
    o, lse = _finish(*carry)
    o_ref[...] = o.astype(o_ref.dtype)
    lse_ref[...] = lse


def ks_bwd_kernel(
    q_ref,
    k_ref,
    v_ref,
    pre_k_ref,
    pre_v_ref,
    *refs,
    block_e,
    unrolled,
    first_block,
    accumulate,
):
    """One query block over the whole e: dq; dk, dv of its own keys; its prefix parts
    (refs: the six _ks_masks arrays, lse, delta, dO, with accumulate the dv to add the own keys'
    to; then the five outputs)."""
    meta_refs = refs[:6]
    lse_ref, delta_ref, do_ref = refs[6:9]
    dv_in_ref = refs[9] if accumulate else None
    dq_ref, dk_ref, dv_ref, dk_pre_ref, dv_pre_ref = refs[10:] if accumulate else refs[9:]
    q, k, pre_k = q_ref[...], k_ref[...], pre_k_ref[...]
    mask_pre, mask_own = _ks_masks(first_block + pl.program_id(1), *meta_refs)
    lse, delta = lse_ref[...], delta_ref[...]
    p_pre = _probs(_dot(q, pre_k, trans_b=True), mask_pre, lse)
    p_own = _probs(_dot(q, k, trans_b=True), mask_own, lse)
    e = do_ref.shape[-1]

    def dot_values(cols, carry):
        """dO.v^T of the prefix and own keys over one column chunk (dS needs every column)."""
        do_c = do_ref[:, cols]
        dp_pre = carry[0] + _dot(do_c, pre_v_ref[:, cols], trans_b=True)
        return dp_pre, carry[1] + _dot(do_c, v_ref[:, cols], trans_b=True)

    init = (jnp.zeros(p_pre.shape, F32), jnp.zeros(p_own.shape, F32))
    dp_pre, dp_own = _over_columns(e, block_e, dot_values, init, unrolled)
    ds_pre, ds_own = _ds(p_pre, dp_pre, delta, q.dtype), _ds(p_own, dp_own, delta, q.dtype)
    dq_ref[...] = _dot(ds_pre, pre_k) + _dot(ds_own, k)
    dk_ref[...] = _dot(ds_own, q, trans_a=True)
    dk_pre_ref[...] = _dot(ds_pre, q, trans_a=True)

    def store_dv(cols, carry):
        """dv of the own and prefix keys over one column chunk."""
        do_c = do_ref[:, cols]
        dv_own = _dot(p_own.astype(do_c.dtype), do_c, trans_a=True)
        dv_ref[:, cols] = (dv_own + dv_in_ref[:, cols]) if accumulate else dv_own
        dv_pre_ref[:, cols] = _dot(p_pre.astype(do_c.dtype), do_c, trans_a=True)
        return carry

    _over_columns(e, block_e, store_dv, 0, unrolled)
