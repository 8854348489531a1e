"""Tests for HAX sparse attention's decoding: the step against a cache equals the parallel op, the
cache built in parallel from a prompt equals the stepped one, and bad step inputs are refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sparse_cases import (
    B_,
    CASE_IDS,
    CASES,
    E_,
    H_,
    N_,
    TOL,
    assert_close,
    make_inputs,
    spec_of,
)

from pallas_kernels.sparse_attention import (
    LinearScore,
    SparseSpec,
    init_cache,
    prefill_cache,
    sparse_attention,
    sparse_attention_step,
)

jax.config.update("jax_enable_x64", False)


@pytest.mark.parametrize("pattern, binning", CASES, ids=CASE_IDS)
def test_step_equals_parallel(pattern, binning):
    """Decoding token by token through the cache (jitted scan of steps) equals the parallel op."""
    l, num_keys = 37, 12
    inputs = make_inputs(l, seed=6)
    spec = spec_of(pattern, num_keys, binning)
    o = sparse_attention(**inputs, spec=spec)
    cache = init_cache(B_, l, N_, E_, spec=spec)

    @jax.jit
    def decode(cache, hash_proj, q_lbn, k_lbn, v_lbe, key_scores_lb):
        """Scan the step over positions."""

        def body(cache, x):
            """One token."""
            q, k, v, score = x
            o, cache = sparse_attention_step(
                q, k, v, cache, spec=spec, hash_proj=hash_proj, key_score=score
            )
            return cache, o

        return jax.lax.scan(body, cache, (q_lbn, k_lbn, v_lbe, key_scores_lb))

    seq = [jnp.moveaxis(inputs[name], 1, 0) for name in ("q", "k", "v", "key_scores")]
    cache, o_lbe = decode(cache, inputs["hash_proj"], *seq)
    assert int(cache.t) == l
    assert_close(jnp.moveaxis(o_lbe, 0, 1), o, TOL[jnp.float32])
    # The cache documents q_sum / k_sum as the sums of everything seen so far.
    assert_close(cache.q_sum, inputs["q"].sum(1), TOL[jnp.float32])
    assert_close(cache.k_sum, inputs["k"].sum(1), TOL[jnp.float32])


@pytest.mark.parametrize("slots", [24, 300])  # compared pairwise; past 256 sorted
def test_step_dedupe_keeps_each_position_once(slots):
    """The step's dedupe keeps each valid position exactly once: per row the kept positions are
    the set of valid ones (written here as Python sets), masked slots read position 0."""
    from pallas_kernels.sparse_attention.decode import step_dedupe

    rng = np.random.default_rng(0)
    j = rng.integers(0, slots // 3, (3, slots)).astype(np.int32)  # many repeats
    valid = rng.random((3, slots)) < 0.7
    j_out, valid_out = map(np.asarray, step_dedupe(jnp.asarray(j), jnp.asarray(valid)))
    for row in range(3):
        kept = j_out[row][valid_out[row]]
        assert sorted(kept) == sorted(set(j[row][valid[row]]))
        assert np.all(j_out[row][~valid_out[row]] == 0)


def test_step_capacity():
    """Stepping past capacity: ValueError naming it when t is concrete, NaN under jit."""
    inputs = make_inputs(3)
    spec = SparseSpec("sw", 2)
    cache = init_cache(B_, 2, N_, E_, spec=spec)
    args = [inputs[name][:, 0] for name in ("q", "k", "v")]
    for _ in range(2):
        _, cache = sparse_attention_step(*args, cache, spec=spec)
    with pytest.raises(ValueError, match="capacity = 2"):
        sparse_attention_step(*args, cache, spec=spec)
    o, _ = jax.jit(lambda c: sparse_attention_step(*args, c, spec=spec))(cache)
    assert np.all(np.isnan(o))


# ---- prefill: the cache after a prompt, built in parallel ----------------------------------

PREFILL_CASES = [
    ("lsh", "sign"),
    ("lsh", "argmax"),
    ("ks", "sign"),
    ("lsh+ks", "sign"),
    ("sw+sink", "sign"),
    ("sw+dilated", "sign"),
    ("full", "sign"),
]


def assert_caches_equal(actual, desired):
    """Every field: the same shape and dtype; ints, keys, values and scores exactly, the fp32
    sums (summed in another order) to rounding."""
    for name in desired._fields:
        a, d = np.asarray(getattr(actual, name)), np.asarray(getattr(desired, name))
        assert (a.shape, a.dtype) == (d.shape, d.dtype), name
        if name in ("q_sum", "k_sum"):
            np.testing.assert_allclose(a, d, **TOL[jnp.float32], err_msg=name)
        else:
            np.testing.assert_array_equal(a, d, err_msg=name)


@pytest.mark.parametrize(
    "pattern, binning", PREFILL_CASES, ids=[f"{p}-{b}" for p, b in PREFILL_CASES]
)
def test_prefill_cache_equals_steps(pattern, binning):
    """prefill_cache from an empty cache is the cache l steps leave (l = 1, 7, 29), with key
    scores holding many ties and a -inf (which the step never keeps); decoding on from either
    cache gives the same outputs."""
    capacity, num_keys, more = 32, 8, 3
    spec = spec_of(pattern, num_keys, binning)
    inputs = make_inputs(capacity, seed=11)  # key scores: small integers, many ties
    inputs["key_scores"] = inputs["key_scores"].at[:, 2].set(-jnp.inf)
    empty = init_cache(B_, capacity, N_, E_, spec=spec)
    hash_proj = inputs["hash_proj"]

    def step(t, cache):
        """Position t's token through the step (jitted once per cache shape)."""
        q, k, v, score = (inputs[name][:, t] for name in ("q", "k", "v", "key_scores"))
        return sparse_attention_step(
            q, k, v, cache, spec=spec, hash_proj=hash_proj, key_score=score
        )

    outs, stepped, cache = [], [], empty
    for t in range(capacity):
        o, cache = step(t, cache)
        outs.append(o)
        stepped.append(cache)
    for l in (1, 7, 29):
        prompt = {name: inputs[name][:, :l] for name in ("q", "k", "v", "key_scores")}
        cache = prefill_cache(**prompt, cache=empty, spec=spec, hash_proj=hash_proj)
        assert_caches_equal(cache, stepped[l - 1])
        for t in range(l, l + more):
            o, cache = step(t, cache)
            assert_close(o, outs[t], TOL[jnp.float32])
        assert_caches_equal(cache, stepped[l + more - 1])


def test_prefill_cache_checks():
    """A fresh cache's t is a NumPy zero, concrete even under a trace (what tells a model's
    prefill that it may build the cache in parallel); a prompt of exactly the capacity fills
    it; a longer one, or a cache already written, is a ValueError naming it."""
    inputs = make_inputs(5)
    spec = SparseSpec("sw+ks", 4)
    seen = []
    jax.make_jaxpr(lambda: seen.append(init_cache(B_, 4, N_, E_, spec=spec).t))()
    assert isinstance(seen[0], np.ndarray) and seen[0].dtype == np.int32 and seen[0] == 0
    prompt = dict(q=inputs["q"], k=inputs["k"], v=inputs["v"], key_scores=inputs["key_scores"])
    full = prefill_cache(**prompt, cache=init_cache(B_, 5, N_, E_, spec=spec), spec=spec)
    assert int(full.t) == 5 and np.all(np.asarray(full.ks_pos) >= 0)
    with pytest.raises(ValueError, match="l = 5.*capacity = 4"):
        prefill_cache(**prompt, cache=init_cache(B_, 4, N_, E_, spec=spec), spec=spec)
    cache = init_cache(B_, 8, N_, E_, spec=spec)
    _, cache = sparse_attention_step(
        *(inputs[name][:, 0] for name in "qkv"),
        cache,
        spec=spec,
        key_score=inputs["key_scores"][:, 0],
    )
    with pytest.raises(ValueError, match="empty cache \\(t = 0\\), got t = 1"):
        prefill_cache(**prompt, cache=cache, spec=spec)


def test_bad_step_arguments_raise():
    """The cache and step check their inputs and name the value."""
    inputs = make_inputs(2)
    q, k, v = (inputs[name][:, 0] for name in ("q", "k", "v"))
    with pytest.raises(ValueError, match="hash_bits \\(h of hash_proj \\(n, h\\)\\) is required"):
        SparseSpec("lsh+ks", 4)
    spec = SparseSpec("lsh+ks", 4, hash_bits=H_)
    with pytest.raises(ValueError, match="spec must be a SparseSpec, got str"):
        init_cache(B_, 4, N_, E_, spec="lsh+ks")
    with pytest.raises(ValueError, match="capacity must be a positive int, got 0"):
        init_cache(B_, 0, N_, E_, spec=spec)
    cache = init_cache(B_, 4, N_, E_, spec=spec)
    hash_proj, score = inputs["hash_proj"], inputs["key_scores"][:, 0]
    official = SparseSpec("lsh+ks", 4, hash_bits=H_, official_code=True)
    with pytest.raises(ValueError, match="official_code=True has no step mode"):
        sparse_attention_step(q, k, v, cache, spec=official, hash_proj=hash_proj, key_score=score)
    with pytest.raises(ValueError, match="key_score \\(b,\\) is required by 'ks'"):
        sparse_attention_step(q, k, v, cache, spec=spec, hash_proj=hash_proj)
    with pytest.raises(ValueError, match="hash_proj must have shape \\(n, h\\) = \\(8, 3\\)"):
        sparse_attention_step(
            q, k, v, cache, spec=spec, hash_proj=jnp.zeros((N_, H_ + 1)), key_score=score
        )
    wider = init_cache(B_, 4, N_, E_, spec=SparseSpec("lsh+ks", 4, hash_bits=H_ + 1))
    with pytest.raises(ValueError, match="cache.lsh_table must have shape"):
        sparse_attention_step(q, k, v, wider, spec=spec, hash_proj=hash_proj, key_score=score)
    bad_weight = LinearScore(jnp.zeros((B_, 5)), jnp.zeros((4,)), jnp.zeros(()))
    with pytest.raises(ValueError, match="key_score.weight must have shape \\(m,\\) = \\(5,\\)"):
        sparse_attention_step(q, k, v, cache, spec=spec, hash_proj=hash_proj, key_score=bad_weight)
    int_bias = LinearScore(jnp.zeros((B_, 5)), jnp.zeros((5,)), jnp.zeros((), jnp.int32))
    with pytest.raises(ValueError, match="key_score.bias must have a floating dtype"):
        sparse_attention_step(q, k, v, cache, spec=spec, hash_proj=hash_proj, key_score=int_bias)
    flat = LinearScore(jnp.zeros((B_,)), jnp.zeros((1,)), jnp.zeros(()))
    with pytest.raises(
        ValueError, match="key_score.features must be \\(b, m\\), got shape \\(2,\\)"
    ):
        sparse_attention_step(q, k, v, cache, spec=spec, hash_proj=hash_proj, key_score=flat)
    with pytest.raises(ValueError, match="v must have shape \\(b, e\\) = \\(2, 6\\)"):
        sparse_attention_step(
            q, k, v[:, :3], cache, spec=spec, hash_proj=hash_proj, key_score=score
        )


@pytest.mark.parametrize("binning", ["sign", "argmax"])
def test_zero_centred_vectors_bucket_the_same_in_parallel_and_decode(binning):
    """A query equal to its running mean (the first token; a run of identical tokens) is zero after
    centring; rounding noise there must not pick a bucket at random. q/k come from a projection
    computed inside each path, as in a model, so the two paths round differently."""
    l, num_keys, d = 23, 8, 5
    rng = np.random.default_rng(3)
    x = rng.standard_normal((B_, l, d), np.float32)
    x[:, 1:7] = x[:, :1]  # seven identical leading tokens
    x, w = jnp.asarray(x), jnp.asarray(rng.standard_normal((d, 2 * N_), np.float32))
    hash_proj = jnp.asarray(rng.standard_normal((N_, H_), np.float32))
    spec = spec_of("lsh", num_keys, binning)

    @jax.jit
    def parallel(x, w):
        q, k = jnp.split(x @ w, 2, axis=-1)
        return sparse_attention(q, k, x, spec=spec, hash_proj=hash_proj)

    @jax.jit
    def decode(x, w):
        def body(cache, x_t):
            q, k = jnp.split(x_t @ w, 2, axis=-1)
            o, cache = sparse_attention_step(q, k, x_t, cache, spec=spec, hash_proj=hash_proj)
            return cache, o

        cache = init_cache(B_, l, N_, d, spec=spec)
        return jnp.moveaxis(jax.lax.scan(body, cache, jnp.moveaxis(x, 1, 0))[1], 0, 1)

    assert_close(decode(x, w), parallel(x, w), TOL[jnp.float32])
