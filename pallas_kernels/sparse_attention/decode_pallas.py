"""HAX sparse attention decoding as two GPU kernels (Pallas Triton): decode.step_arrays fused.

decode.step_arrays is a dozen small XLA kernels a layer and token (the running sums, the LSH
centring, hash and table, the running top-kc, the slot lists, the dedupe, two gathers and the
softmax); at batch 1 each runs for a few microseconds, so the branch cost more than the Mamba-2
layer beside it (BENCHMARKS.md, "Generation speed"). Here:

`_select_kernel`, one program a batch row, never reads ks's score, so it need not wait for the
scorer (under concurrent CUDA graphs the two run at once):
1. loads the old state (sums, the LSH table's two rows, the top-kc lists) and builds the slots:
   slot s belongs to component s // kc, at rank r = s % kc, in the pattern's order, as
   step_arrays concatenates them (padding slots to a power of two are never valid), de-duplicated;
   writes the selected positions (-1 where a slot is not valid, PAST_CAPACITY in every slot once
   the cache is full). ks's slots are the old list's first kc - 1, which t's insertion keeps; its
   last slot is contested (t's position or the old list's last, whichever t's score leaves in the
   list), and the kernel writes what attend needs to settle it;
2. barrier, then writes the new state in place: k and v at row t, the key bucket's table row
   shifted left with t last, the key sum. The barrier matters because a program's threads read
   and write the same rows. (The scorer reads the old query sum: attend, which runs after it,
   adds q to it.)
`_attend_kernel`, one program a batch row and chunk of the value columns (so that at batch 1 the
value rows are gathered by many SMs at once): applies the scorer's last layer (decode.LinearScore)
to settle the contested slot, gathers the selected key rows, takes the softmax over the valid
slots and gathers its chunk of the value rows. It runs after the first kernel, so it reads row
t from the buffers; a row's first program inserts t's score into the top-kc lists and adds q to
the query sum, and the first program of all advances t in place (one kernel fewer a layer than
an add after it).

Same contract as step_arrays, except past the cache's capacity, where both give NaN outputs but
these kernels leave the buffers as they were (step_arrays's dynamic_update_slice writes the last
row again). Letters as in decode.py; S slots.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ..backend import compiler_params, interpret_for
from .decode import LinearScore
from .reference import NOISE_RTOL

F32 = jnp.float32
MAX_VALUE_CHUNK = 128  # value columns an attend program gathers: (S, chunk) fp32 in registers
# In every slot once t has reached capacity: the attend kernel's outputs are NaN (it never reads
# t, which its first program overwrites).
PAST_CAPACITY = -2


def _pow2(x):
    """The next power of two >= x (Triton vector lengths)."""
    return 1 << max(0, (x - 1).bit_length())


def unsupported(spec, n, e):
    """Why this kernel cannot run `spec` with key dim n and value dim e, or None if it can."""
    if spec.has("full"):
        return "the 'full' component reads every cache row (decode.step_arrays does)"
    if n != _pow2(n):
        return f"the key dim n = {n} is not a power of two"
    if e % 16:
        return f"the value dim e = {e} is not a multiple of 16"
    return None


def _value_chunk(e):
    """Columns of v a program reads: the largest power of two dividing e, at most 128."""
    return min(MAX_VALUE_CHUNK, e & -e)


def _contested_slot(spec):
    """The slot of ks's last rank: t's position or the old list's last, by t's score."""
    kc = spec.keys_per_component
    return spec.components.index("ks") * kc + kc - 1


def _buckets(x, x_sum, count, hash_proj, binning, hash_bits):
    """LSH bucket (int32 scalar) of x (n,) centred by its running mean x_sum / count, as
    reference.centred + lsh_buckets compute it (projections within NOISE_RTOL of zero count as
    zero)."""
    mean = x_sum / count
    scale = jnp.sqrt(jnp.sum(x * x)) + jnp.sqrt(jnp.sum(mean * mean))
    proj_h = jnp.sum((x - mean)[:, None] * hash_proj, axis=0)
    col_h = jnp.arange(hash_proj.shape[1], dtype=jnp.int32)
    tol_h = NOISE_RTOL * scale * jnp.sqrt(jnp.sum(hash_proj * hash_proj, axis=0))
    proj_h = jnp.where(jnp.abs(proj_h) <= tol_h, 0.0, proj_h)
    if binning == "argmax":  # the first of the largest, padding columns excluded
        proj_h = jnp.where(col_h < hash_bits, proj_h, -jnp.inf)
        return jnp.min(jnp.where(proj_h == jnp.max(proj_h), col_h, hash_proj.shape[1]))
    bits_h = jnp.where(col_h < hash_bits, jnp.left_shift(1, col_h), 0)
    return jnp.sum(jnp.where(proj_h > 0, bits_h, 0))


def _select_kernel(
    t_ref, q_ref, k_ref, v_ref, hash_ref, qsum_ref, ksum_ref, table_ref, kss_ref, ksp_ref,
    keys_in, values_in,
    j_ref, contest_ref, last_score_ref, ksum_out, table_out, keys_ref, values_ref,
    *, spec, capacity, chunk, compiled,
):  # fmt: skip
    kc, comps = spec.keys_per_component, spec.components
    slots = j_ref.shape[0]  # len(comps) * kc padded to a power of two (step_pallas)
    del keys_in, values_in  # aliased to keys_ref / values_ref
    t = t_ref[0]
    q, k = q_ref[...].astype(F32), k_ref[...].astype(F32)
    q_sum, k_sum = qsum_ref[...] + q, ksum_ref[...] + k
    s_s = jnp.arange(slots, dtype=jnp.int32)
    comp_s, r_s = s_s // kc, s_s % kc
    j_s = jnp.zeros((slots,), jnp.int32)
    valid_s = jnp.zeros((slots,), jnp.bool_)
    # (ref, index, value): step 2's stores, after every load of old state. Every slot writes: a
    # value depends on the rank r alone, so the slots of one rank write the same value to the
    # same place (a mask would not do: the interpreter's masked scatter rewrites the old value).
    writes = []
    for ci, comp in enumerate(comps):
        mine_s = comp_s == ci
        if comp == "sw":
            jc_s, okc_s = t - r_s, t - r_s >= 0
        elif comp == "sink":
            jc_s, okc_s = r_s, r_s <= t
        elif comp == "dilated":
            d = spec.dilation
            jc_s = ((t + 1) // d) * d - 1 - d * r_s
            okc_s = jc_s >= 0
        elif comp == "lsh":
            count = (t + 1).astype(F32)
            hash_proj = hash_ref[...].astype(F32)
            lsh = dict(hash_proj=hash_proj, binning=spec.binning, hash_bits=spec.hash_bits)
            bucket_k = _buckets(k, k_sum, count, **lsh)
            bucket_q = _buckets(q, q_sum, count, **lsh)
            # The key bucket's row after the push: shifted left one slot, t in the last.
            bucket_k_s, bucket_q_s = (
                jnp.full((slots,), x, jnp.int32) for x in (bucket_k, bucket_q)
            )
            shifted_s = table_ref[bucket_k_s, jnp.minimum(r_s + 1, kc - 1)]
            new_row_s = jnp.where(r_s == kc - 1, t, shifted_s)
            query_row_s = table_ref[bucket_q_s, r_s]
            jc_s = jnp.where(bucket_q == bucket_k, new_row_s, query_row_s)
            okc_s = jc_s >= 0
            writes.append((table_out, (bucket_k_s, r_s), new_row_s))
        else:  # ks: the old list's first kc - 1; its last slot is t's or the old last's (attend)
            jc_s = jnp.where(r_s == kc - 1, -1, ksp_ref[r_s])
            okc_s = jc_s >= 0
        j_s = jnp.where(mine_s, jc_s, j_s)
        valid_s = jnp.where(mine_s, okc_s, valid_s)
    if len(comps) > 1:  # each position once, in its first slot (decode.step_dedupe)
        earlier_ss = s_s[None, :] < s_s[:, None]
        same_ss = (j_s[:, None] == j_s[None, :]) & valid_s[None, :] & earlier_ss
        valid_s = valid_s & (jnp.max(same_ss.astype(jnp.int32), axis=1) == 0)  # Triton: no any
    j_s = jnp.where(valid_s, j_s, -1)
    j_ref[...] = jnp.where(t < capacity, j_s, PAST_CAPACITY).astype(jnp.int32)
    if spec.has("ks"):
        # For attend, which knows t's score: t, the old last (position, score), and whether
        # either is already in an earlier slot (then the contested slot repeats it).
        old_last = ksp_ref[kc - 1]
        earlier_s = valid_s & (s_s < _contested_slot(spec))
        seen = lambda j: jnp.max(jnp.where(earlier_s & (j_s == j), 1, 0))  # noqa: E731
        i_c = jnp.arange(4, dtype=jnp.int32)
        contest_c = jnp.where(i_c == 0, t, jnp.where(i_c == 1, old_last, seen(t)))
        contest_ref[...] = jnp.where(i_c == 3, seen(old_last), contest_c).astype(jnp.int32)
        last_score_ref[...] = jnp.full((1,), kss_ref[kc - 1], F32)

    if compiled:  # the interpreter runs one thread: nothing to order
        pltriton.debug_barrier()  # every old row read before any is overwritten
    ksum_out[...] = k_sum
    for ref, index, value in writes:
        ref[index] = value
    row_t = jnp.minimum(t, capacity - 1)
    inside = t < capacity  # past capacity the buffers keep what they hold
    n = k.shape[0]
    pltriton.store(
        keys_ref.at[row_t, pl.ds(0, n)],
        k.astype(keys_ref.dtype),
        mask=jnp.full((n,), inside),
    )

    def write_v(c, carry):
        cols = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
        pltriton.store(
            values_ref.at[row_t, cols],
            v_ref[cols].astype(values_ref.dtype),
            mask=jnp.full((chunk,), inside),
        )
        return carry

    jax.lax.fori_loop(0, v_ref.shape[0] // chunk, write_v, 0)


def _attend_kernel(
    q_ref, j_ref, contest_ref, last_score_ref, feat_ref, weight_ref, bias_ref, kss_in, ksp_in,
    qsum_in, keys_ref, values_ref, t_in,
    o_ref, kss_ref, ksp_ref, qsum_ref, t_ref, *, spec, compiled,
):  # fmt: skip
    """Softmax over the selected rows (j < 0: not selected) and this program's value columns;
    with ks, t's score decides the contested slot, and the row's first program inserts it into
    the top-kc lists and adds q to the query sum; the first program of all writes t + 1 over t
    (each *_in aliases its output)."""
    del t_in, kss_in, ksp_in, qsum_in
    first_of_row = pl.program_id(1) == 0

    @pl.when(first_of_row)  # each element read and written by the same thread: no barrier
    def _():
        qsum_ref[...] = qsum_ref[...] + q_ref[...].astype(F32)

    @pl.when((pl.program_id(0) == 0) & first_of_row)
    def _():
        t_ref[...] = t_ref[...] + 1

    j_s = j_ref[...]
    full = jnp.min(j_s) == PAST_CAPACITY
    if spec.has("ks"):
        t, old_last = contest_ref[0], contest_ref[1]
        score = jnp.sum(feat_ref[...] * weight_ref[...]) + bias_ref[0]
        # decode.insert_top puts t after every kept score >= it: it stays iff the last is not.
        enters = jnp.logical_not(last_score_ref[0] >= score)
        contested = jnp.where(enters, t, old_last)
        repeated = jnp.where(enters, contest_ref[2], contest_ref[3]) > 0
        s_s = jnp.arange(j_s.shape[0], dtype=jnp.int32)
        slot = _contested_slot(spec)
        j_s = jnp.where((s_s > slot) & (j_s == contested), -1, j_s)  # its later repeats
        j_s = jnp.where(s_s == slot, jnp.where(repeated, -1, contested), j_s)

        # Every program computes the lists after t's insertion and meets the barrier (none sits
        # inside a branch); the row's first program writes them.
        r_s, new_scores_s, new_pos_s = _insert_top(
            kss_ref, ksp_ref, score, t, kc=spec.keys_per_component
        )
        if compiled:  # every old rank read before any is overwritten
            pltriton.debug_barrier()

        @pl.when(first_of_row)
        def _():
            kss_ref[r_s] = new_scores_s
            ksp_ref[r_s] = new_pos_s

    valid_s = j_s >= 0
    j_s = jnp.where(valid_s, j_s, 0)
    q = q_ref[...].astype(F32)
    k_sn = keys_ref[j_s, pl.ds(0, q.shape[0])].astype(F32)
    scores_s = jnp.where(valid_s, jnp.sum(q[None, :] * k_sn, axis=1), 0.0)
    top = jnp.max(jnp.where(valid_s, scores_s, -jnp.inf))
    top = jnp.where(top > -jnp.inf, top, 0.0)
    weights_s = jnp.where(valid_s, jnp.exp(scores_s - top), 0.0)
    denom = jnp.sum(weights_s)
    v_sc = values_ref[j_s, pl.ds(0, o_ref.shape[0])].astype(F32)
    o_c = jnp.sum(weights_s[:, None] * v_sc, axis=0) / jnp.where(denom > 0, denom, 1.0)
    nan_c = jnp.full(o_c.shape, jnp.nan, F32)
    o_ref[...] = jnp.where(full, nan_c, o_c).astype(o_ref.dtype)


def _insert_top(scores_ref, pos_ref, score, t, *, kc):
    """decode.insert_top of one row's lists (kc long): (ranks, scores, positions) after t's score
    goes after every kept score >= it, the rest down one rank and the last dropped. Ranks padded
    to a power of two repeat the last rank (written, they write the same value to the same
    place)."""
    r_s = jnp.minimum(jnp.arange(_pow2(kc), dtype=jnp.int32), kc - 1)
    old_scores_s, old_pos_s = scores_ref[r_s], pos_ref[r_s]
    at = jnp.sum(jnp.where((r_s == jnp.arange(r_s.shape[0])) & (old_scores_s >= score), 1, 0))
    down_s = jnp.maximum(r_s - 1, 0)
    down_scores_s = jnp.where(r_s == 0, score, scores_ref[down_s])
    down_pos_s = jnp.where(r_s == 0, t, pos_ref[down_s])
    before_s, here_s = r_s < at, r_s == at
    new_scores_s = jnp.where(before_s, old_scores_s, jnp.where(here_s, score, down_scores_s))
    new_pos_s = jnp.where(before_s, old_pos_s, jnp.where(here_s, t, down_pos_s))
    return r_s, new_scores_s, new_pos_s


def _linear_score(key_score, b):
    """ks's score as (features (b, m), weight (m,), bias (1,)) fp32, m padded to a power of two
    with zeros; a plain score (b,) as itself times 1 plus 0 (exactly itself)."""
    if isinstance(key_score, LinearScore):
        features, weight, bias = (x.astype(F32) for x in key_score)
    else:
        features, weight, bias = key_score.astype(F32)[:, None], jnp.ones((1,), F32), jnp.zeros(())
    pad = _pow2(weight.shape[0]) - weight.shape[0]
    features, weight = jnp.pad(features, ((0, 0), (0, pad))), jnp.pad(weight, (0, pad))
    return features, weight, bias.astype(F32).reshape(1)


def step_pallas(q, k, v, cache, *, spec, hash_proj=None, key_score=None, interpret=None):
    """One decode step (no validation; see ops.sparse_attention_step, and `unsupported` for the
    specs it takes): returns (o, cache), as decode.step_arrays does."""
    b, capacity, n = cache.keys.shape
    e = v.shape[-1]
    t = jnp.asarray(cache.t, jnp.int32)
    # Absent components get a one-element stand-in (never read or written).
    if spec.has("lsh"):
        hash_bits = hash_proj.shape[1]
        hash_proj = jnp.pad(hash_proj.astype(F32), ((0, 0), (0, _pow2(hash_bits) - hash_bits)))
        table = cache.lsh_table
    else:
        hash_proj, table = jnp.zeros((1, 1), F32), jnp.zeros((b, 1, 1), jnp.int32)
    if spec.has("ks"):
        features, weight, bias = _linear_score(key_score, b)
        ks_scores, ks_pos = cache.ks_scores, cache.ks_pos
    else:
        features, weight, bias = jnp.zeros((b, 1), F32), jnp.zeros((1,), F32), jnp.zeros((1,), F32)
        ks_scores, ks_pos = jnp.zeros((b, 1), F32), jnp.zeros((b, 1), jnp.int32)
    row = lambda *tail: pl.BlockSpec((None, *tail), lambda i: (i,) + (0,) * len(tail))  # noqa: E731
    whole = lambda x: pl.BlockSpec(x.shape, lambda i: (0,) * x.ndim)  # noqa: E731
    args = (t.reshape(1), q, k, v, hash_proj, cache.q_sum, cache.k_sum, table, ks_scores, ks_pos,
            cache.keys, cache.values)  # fmt: skip
    in_specs = [whole(args[0]), row(n), row(n), row(e), whole(hash_proj), row(n), row(n),
                row(*table.shape[1:]), row(ks_scores.shape[1]), row(ks_pos.shape[1]),
                row(capacity, n), row(capacity, e)]  # fmt: skip
    slots = _pow2(len(spec.components) * spec.keys_per_component)
    # contest: t, the old list's last position, whether t / it already fill an earlier slot.
    like = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
    out_shape = (jax.ShapeDtypeStruct((b, slots), jnp.int32),
                 jax.ShapeDtypeStruct((b, 4), jnp.int32), jax.ShapeDtypeStruct((b, 1), F32),
                 *map(like, (cache.k_sum, table, cache.keys, cache.values)))  # fmt: skip
    interpret = interpret_for("gpu", interpret)
    chunk = _value_chunk(e)
    select = functools.partial(
        _select_kernel, spec=spec, capacity=capacity, chunk=chunk, compiled=not interpret
    )
    j, contest, last_score, k_sum, table, keys, values = pl.pallas_call(
        select,
        grid=(b,),
        in_specs=in_specs,
        out_specs=[row(slots), row(4), row(1)] + in_specs[6:8] + in_specs[10:],
        out_shape=out_shape,
        # The state is updated in place (the program writes a few rows of it); the top-kc lists
        # by the attend kernel, which knows t's score, and the query sum by it too, so that the
        # scorer (XLA, reading the old sum) need not run before this kernel.
        input_output_aliases={6: 3, 7: 4, 10: 5, 11: 6},
        interpret=interpret,
        compiler_params=compiler_params("gpu", num_warps=4, num_stages=1),
    )(*args)
    at = lambda block: lambda i, c: (i,) + block(c)  # noqa: E731
    by_row = lambda *tail: pl.BlockSpec((None, *tail), at(lambda c: (0,) * len(tail)))  # noqa: E731
    one = pl.BlockSpec((1,), lambda i, c: (0,))
    attend = functools.partial(_attend_kernel, spec=spec, compiled=not interpret)
    o, ks_scores, ks_pos, q_sum, t = pl.pallas_call(
        attend,
        grid=(b, e // chunk),
        in_specs=[
            *(by_row(n), by_row(slots), by_row(4), by_row(1), by_row(features.shape[1])),
            pl.BlockSpec(weight.shape, lambda i, c: (0,)),
            *(one, by_row(ks_scores.shape[1]), by_row(ks_pos.shape[1]), by_row(n)),
            by_row(capacity, n),
            pl.BlockSpec((None, capacity, chunk), at(lambda c: (0, c))),
            one,
        ],
        out_specs=[
            pl.BlockSpec((None, chunk), at(lambda c: (c,))),
            by_row(ks_scores.shape[1]),
            by_row(ks_pos.shape[1]),
            by_row(n),
            one,
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, e), v.dtype),
            *map(like, (ks_scores, ks_pos, cache.q_sum)),
            jax.ShapeDtypeStruct((1,), jnp.int32),
        ],
        input_output_aliases={7: 1, 8: 2, 9: 3, 12: 4},
        interpret=interpret,
        compiler_params=compiler_params("gpu", num_warps=4, num_stages=1),
    )(q, j, contest, last_score, features, weight, bias, ks_scores, ks_pos, cache.q_sum, keys,
      values, args[0])  # fmt: skip
    new = dict(keys=keys, values=values, t=t.reshape(()), q_sum=q_sum, k_sum=k_sum)
    if spec.has("lsh"):
        new["lsh_table"] = table
    if spec.has("ks"):
        new.update(ks_scores=ks_scores, ks_pos=ks_pos)
    return o, cache._replace(**new)
