"""Tests for the Pallas HAX sparse attention (impl="pallas"): equal to the indexed path in
values and gradients (interpret mode on CPU, compiled on GPU), TPU interpret on a tiny shape,
cross-lowering of both variants, the block layout, and the refused patterns."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_checks import COMPILED, assert_close

from pallas_kernels.backend import lower_for
from pallas_kernels.sparse_attention import SparseSpec, sparse_attention
from pallas_kernels.sparse_attention.ops import sparse_attention_of_layout
from pallas_kernels.sparse_attention.pallas import layout_of
from pallas_kernels.sparse_attention.reference import running_buckets
from pallas_kernels.sparse_attention.tiling import BlockSizes, lsh_layout, tile_schedule

F32, BF16 = jnp.float32, jnp.bfloat16
# Forward and gradient tolerances per input dtype. bf16: outputs and gradients are rounded to
# bf16 once, and the kernels' P.V / P^T.dO products take P in bf16, their dS.k / dS^T.q products
# dS in bf16 (flash attention's rule).
TOL = {F32: dict(atol=1e-5, rtol=1e-5), BF16: dict(atol=1e-2, rtol=1e-2)}
GRAD_TOL = {F32: dict(atol=1e-5, rtol=1e-4), BF16: dict(atol=2e-2, rtol=2e-2)}
DIFF_ARGS = ("q", "k", "v", "hash_proj", "key_scores")


def make_inputs(b, l, n, e, hash_bits, dtype=F32, seed=0):
    """Random q, k, v, hash_proj; key_scores are small integers, so ks sees many ties."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape, np.float32)  # noqa: E731
    return dict(
        q=jnp.asarray(normal(b, l, n), dtype),
        k=jnp.asarray(normal(b, l, n) / np.sqrt(n), dtype),
        v=jnp.asarray(normal(b, l, e), dtype),
        hash_proj=jnp.asarray(normal(n, hash_bits)),
        key_scores=jnp.asarray(rng.integers(0, 6, (b, l)).astype(np.float32), dtype),
    )


@functools.partial(jax.jit, static_argnames=("static",))
def _output_and_grads(inputs, w, static):
    """o and the vjp of a random cotangent w wrt every differentiable input."""

    def attend(*args):
        return sparse_attention(*args[:3], **dict(zip(DIFF_ARGS[3:], args[3:])), **dict(static))

    o, vjp = jax.vjp(attend, *(inputs[name] for name in DIFF_ARGS))
    return o, dict(zip(DIFF_ARGS, vjp(w.astype(o.dtype))))


def output_and_grads(inputs, **static):
    """(o, grads by name) of sparse_attention with these static arguments, jitted once."""
    w = np.random.default_rng(9).standard_normal(inputs["v"].shape, np.float32)
    return _output_and_grads(inputs, jnp.asarray(w), tuple(sorted(static.items())))


def check_against_indexed(inputs, dtype, pallas_args, **static):
    """Pallas (with its own pallas_args: variant, blocks) equals the indexed path in values and
    gradients; returns the Pallas output."""
    o, grads = output_and_grads(inputs, impl="pallas", **pallas_args, **static)
    o_ref, grads_ref = output_and_grads(inputs, impl="indexed", **static)
    assert o.dtype == dtype and o.shape == o_ref.shape
    assert_close(o, o_ref, TOL[dtype], "o")
    for name in DIFF_ARGS:
        assert grads[name].dtype == grads_ref[name].dtype, name
        assert np.all(np.isfinite(np.asarray(grads[name], np.float32))), name
        assert_close(grads[name], grads_ref[name], GRAD_TOL[dtype], name)
    return o


# (pattern, binning, dtype, l, num_keys, block_q, block_k): l is never a multiple of the blocks;
# kc = 20 > block_k spreads a query's lsh keys over several key tiles; "ks+lsh" is the same
# union as "lsh+ks". "lsh" alone: test_queries_with_no_key_output_zero.
CASES = [
    ("lsh+ks", "sign", F32, 37, 12, 16, 16),
    ("ks+lsh", "argmax", BF16, 70, 40, 32, 16),
    ("ks", "sign", F32, 37, 12, 16, 32),
]


@pytest.mark.parametrize("pattern, binning, dtype, l, num_keys, block_q, block_k", CASES)
def test_matches_indexed(pattern, binning, dtype, l, num_keys, block_q, block_k):
    """Interpret mode (gpu variant): o and the gradients wrt q, k, v, hash_proj and key_scores
    (zero: the selection is discrete) equal the indexed path's."""
    inputs = make_inputs(2, l, 8, 6, 3, dtype)
    blocks = dict(block_q=block_q, block_k=block_k, block_e=16)
    check_against_indexed(
        inputs, dtype, blocks, pattern=pattern, num_keys=num_keys, binning=binning
    )


def test_queries_with_no_key_output_zero():
    """lsh alone, with buckets that hold no key yet (as in test_sparse_attention): equal to the
    indexed path, so those rows output 0 with zero gradient; default (64-wide) blocks > l."""
    l = 37
    inputs = make_inputs(2, l, 8, 6, 2, seed=2)
    inputs["hash_proj"] = jnp.eye(8, 2, dtype=F32)
    inputs["k"] = inputs["k"].at[:, :, 0].set(-0.1 * jnp.arange(l, dtype=F32))
    o = check_against_indexed(inputs, F32, {}, pattern="lsh", num_keys=4, binning="sign")
    empty = np.all(np.asarray(o) == 0, axis=-1)
    assert empty.sum() >= 10 and (~empty).sum() >= 10


def test_keys_scored_minus_inf_are_never_selected():
    """Keys scored -inf (the first 20, as a sequence shard's empty carried rows, and every
    seventh): no ks candidate, also for queries with fewer than kc finite keys before them;
    equal to the indexed path."""
    l = 70
    inputs = make_inputs(2, l, 8, 6, 3, seed=3)
    minus_inf = (np.arange(l) < 20) | (np.arange(l) % 7 == 0)
    inputs["key_scores"] = jnp.where(minus_inf, -jnp.inf, inputs["key_scores"])
    blocks = dict(block_q=16, block_k=16, block_e=16)
    check_against_indexed(inputs, F32, blocks, pattern="lsh+ks", num_keys=24, binning="sign")


def check_queries_after_leading_keys(pattern, dtype, lk, first, n, e, blocks, variant=None):
    """Queries that are the last lk - first of lk keys, nothing computed for the first `first`
    as queries: o and the gradients of q, k and v equal the indexed path's over the whole
    sequence at those queries."""
    inputs = make_inputs(2, lk, n, e, 3, dtype, seed=5)
    spec = SparseSpec(pattern=pattern, num_keys=12, hash_bits=3)
    buckets = scores = None
    n_buckets = spec.num_buckets if spec.has("lsh") else 0
    if spec.has("lsh"):
        bucket_q, bucket_k = (
            running_buckets(inputs[x], inputs["hash_proj"], spec.binning) for x in ("q", "k")
        )
        buckets = (bucket_q[:, first:], bucket_k)
    if spec.has("ks"):
        scores = inputs["key_scores"]
    layout = layout_of(
        buckets, scores, spec=spec, blocks=blocks, n_buckets=n_buckets, n_queries=lk - first
    )
    w = jnp.asarray(np.random.default_rng(1).standard_normal((2, lk - first, e)), dtype)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    selection = dict(hash_proj=inputs["hash_proj"], key_scores=inputs["key_scores"])

    def tail(q_tail, k, v):
        return sparse_attention_of_layout(
            q_tail, k, v, layout, spec, blocks=blocks, variant=variant
        )

    def whole(q, k, v):
        return sparse_attention(q, k, v, spec=spec, impl="indexed", **selection)[:, first:]

    o, vjp = jax.vjp(jax.jit(tail), q[:, first:], k, v)
    o_ref, vjp_ref = jax.vjp(whole, q, k, v)
    assert o.shape == o_ref.shape == w.shape
    assert_close(o, o_ref, TOL[dtype], "o")
    grads, grads_ref = vjp(w), vjp_ref(w)
    assert_close(grads[0], grads_ref[0][:, first:], GRAD_TOL[dtype], "q")
    for name, got, want in zip("kv", grads[1:], grads_ref[1:]):
        assert_close(got, want, GRAD_TOL[dtype], name)


@pytest.mark.parametrize("pattern, dtype", [("lsh+ks", F32), ("lsh", F32), ("ks", BF16)])
def test_queries_after_leading_keys(pattern, dtype):
    """The last 38 of 70 keys as queries (a sequence shard's after 32 carried keys,
    carry_pallas.py), interpreted."""
    blocks = BlockSizes(block_q=16, block_k=16, block_e=16)
    check_queries_after_leading_keys(pattern, dtype, 70, 32, 8, 6, blocks)


@pytest.mark.gpu
def test_compiled_gpu_queries_after_leading_keys(monkeypatch):
    """Compiled Triton kernels, bf16, the default blocks: the last 1,000 of 2,024 keys as
    queries, e = 1536 (HAX's value width)."""
    monkeypatch.setitem(COMPILED, "on", True)
    check_queries_after_leading_keys("lsh+ks", BF16, 2024, 1024, 16, 1536, BlockSizes(), "gpu")


@pytest.mark.parametrize(
    "lk, lq, match", [(70, 50, "must be a nonnegative multiple of"), (30, 40, "-10 = 30 keys")]
)
def test_queries_after_leading_keys_refuses_unaligned(lk, lq, match):
    """Leading keys that are not a whole number of blocks (or fewer keys than queries): a
    ValueError naming the counts."""
    spec = SparseSpec(pattern="ks", num_keys=4)
    with pytest.raises(ValueError, match=match):
        layout_of(
            None, jnp.zeros((1, lk)), spec=spec, blocks=BlockSizes(), n_buckets=0, n_queries=lq
        )


def test_tpu_variant_interpret():
    """The tpu variant (Mosaic semantics: DMA of run-time tiles, SMEM schedules) in TPU
    interpret mode on a tiny shape."""
    inputs = make_inputs(1, 20, 8, 6, 3, seed=3)
    check_against_indexed(
        inputs,
        F32,
        dict(variant="tpu", block_q=16, block_k=16, block_e=16),
        pattern="lsh+ks",
        num_keys=12,
    )


@pytest.mark.parametrize("platform, variant", [("cuda", "gpu"), ("tpu", "tpu")])
def test_lowers_at_hax_shape(platform, variant):
    """Forward and backward at the HAX branch shape (b1, l8192, n16, e1536, bf16, 64 keys)
    lower for the variant's platform: every kernel has a lowering, blocks are legal."""
    b, l, n, e = 1, 8192, 16, 1536
    spec = jax.ShapeDtypeStruct
    q = spec((b, l, n), BF16)

    def fwd_bwd(q, k, v, hash_proj, key_scores):
        def loss(q, k, v):
            o = sparse_attention(
                q,
                k,
                v,
                pattern="lsh+ks",
                num_keys=64,
                hash_proj=hash_proj,
                key_scores=key_scores,
                impl="pallas",
                variant=variant,
                interpret=False,
            )
            return jnp.sum(o.astype(F32))

        return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

    args = (q, q, spec((b, l, e), BF16), spec((n, 8), F32), spec((b, l), F32))
    text = lower_for(platform, fwd_bwd, *args)
    target = "__gpu$xla.gpu.triton" if platform == "cuda" else "tpu_custom_call"
    assert text.count(target) >= 5  # lsh fwd, ks fwd, lsh pair, lsh dv, ks bwd


def _brute_lsh_sets(bucket_q, bucket_k, kc):
    """Per query the kc most recent keys j <= its position of its bucket (one batch row; the
    queries are the last len(bucket_q) key positions)."""
    first = len(bucket_k) - len(bucket_q)
    sets = []
    for i, bq in enumerate(bucket_q):
        same = [j for j in range(first + i + 1) if bucket_k[j] == bq]
        sets.append(set(same[-kc:]))
    return sets


# (n_buckets, queries): the packed int32 sort and the two-key sort; every key a query, or the
# queries the last 58 of 90 keys (a sequence shard's after 32 carried keys).
@pytest.mark.parametrize("n_buckets, lq", [(5, 90), (2**30, 90), (5, 58)])
def test_layout_and_schedule(n_buckets, lq):
    """Each sorted query's slots [lo, hi) hold exactly its lsh set; each query block lists
    exactly the key tiles its queries need; the transposed schedule lists the same pairs."""
    rng = np.random.default_rng(4)
    b, lk, kc, block_q, block_k, k_length = 2, 90, 7, 16, 8, 96
    q_length = k_length - (lk - lq)
    draw = lambda l: rng.integers(0, 5, (b, l)) * (n_buckets // 5)  # noqa: E731
    bucket_q, bucket_k = draw(lq), draw(lk)
    lay = jax.jit(lsh_layout, static_argnums=(2, 3, 4, 5))(
        jnp.asarray(bucket_q, jnp.int32),
        jnp.asarray(bucket_k, jnp.int32),
        kc,
        q_length,
        k_length,
        n_buckets,
    )
    schedule = jax.jit(tile_schedule, static_argnums=(2, 3, 4, 5))
    sched = schedule(lay.lo, lay.hi, block_q, block_k, kc, k_length)
    sched = jax.tree.map(np.asarray, sched)
    lo, hi = np.asarray(lay.lo), np.asarray(lay.hi)
    key_perm, query_perm = np.asarray(lay.key_perm), np.asarray(lay.query_perm)
    for row in range(b):
        brute = _brute_lsh_sets(bucket_q[row], bucket_k[row], kc)
        need = {}
        for s in range(q_length):
            got = set(key_perm[row, lo[row, s] : hi[row, s]].tolist())
            i = query_perm[row, s]
            assert got == (brute[i] if i < lq else set()), (row, i)
            tiles = range(lo[row, s] // block_k, -(-hi[row, s] // block_k))
            need.setdefault(s // block_q, set()).update(tiles if hi[row, s] > lo[row, s] else ())
        pairs = []
        for c in range(q_length // block_q):
            start, count = sched.block_offset[row, c], sched.block_count[row, c]
            tiles = sched.pair_tile[row, start : start + count].tolist()
            assert tiles == sorted(need[c]), c
            pairs += [(t, c) for t in tiles]
        assert int(sched.pair_count[row]) == len(pairs) <= sched.pair_tile.shape[1]
        transposed = []
        for t in range(k_length // block_k):
            start, count = sched.tile_offset[row, t], sched.tile_count[row, t]
            transposed += [(t, int(c)) for c in sched.tile_block[row, start : start + count]]
        assert transposed == sorted(pairs)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(pattern="sw+lsh"), r"supports the patterns \('lsh', 'ks', 'lsh\+ks'\).*'sw\+lsh'"),
        (dict(pattern="full"), r"supports the patterns .*'full'"),
        (dict(pattern="sink+ks"), r"supports the patterns .*'sink\+ks'"),
        (dict(pattern="dilated", max_len=64), r"supports the patterns .*'dilated'"),
        (dict(official_code=True), "no official_code mode"),
        (dict(variant="cpu"), "variant must be one of"),
        (dict(block_q=48), "block_q must be a power of two >= 16, got 48"),
        (dict(block_e=8), "block_e must be a power of two >= 16, got 8"),
        (dict(num_warps=0), "num_warps must be a positive int, got 0"),
        (dict(impl="triton"), "impl must be one of"),
    ],
)
def test_bad_arguments_raise(change, match):
    """Unsupported patterns and bad tuning arguments: ValueError naming the value."""
    inputs = make_inputs(1, 8, 4, 4, 2)
    kwargs = dict(pattern="lsh+ks", num_keys=4, impl="pallas") | change
    with pytest.raises(ValueError, match=match):
        sparse_attention(**inputs, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype, b, l, e, blocks",
    [(BF16, 1, 4096, 1536, {}), (F32, 2, 1000, 256, dict(block_q=32, block_k=32, block_e=64))],
)
def test_compiled_gpu_matches_indexed(dtype, b, l, e, blocks, monkeypatch):
    """Compiled Triton kernels at the HAX shape (bf16, n16, e1536, 64 keys) and an fp32 shape
    with l not a multiple of the blocks: values and gradients equal the indexed path's."""
    monkeypatch.setitem(COMPILED, "on", True)
    inputs = make_inputs(b, l, 16, e, 8, dtype, seed=7)
    check_against_indexed(
        inputs, dtype, dict(variant="gpu", **blocks), pattern="lsh+ks", num_keys=64
    )
