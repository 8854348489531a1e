"""Tests for HAX sparse attention: indexed op == dense oracle, causality, decode, cost, errors."""

import functools

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sparse_attention import (
    SparseSpec,
    init_cache,
    lsh_buckets,
    prefill_cache,
    running_mean,
    sparse_attention,
    sparse_attention_mask,
    sparse_attention_reference,
    sparse_attention_step,
)

jax.config.update("jax_enable_x64", False)

# Forward and gradient tolerances, per input dtype. bf16: outputs are rounded to bf16 once.
TOL = {jnp.float32: dict(atol=1e-5, rtol=1e-5), jnp.bfloat16: dict(atol=1e-2, rtol=1e-2)}
GRAD_TOL = dict(atol=1e-5, rtol=1e-4)

B_, N_, E_, H_ = 2, 8, 6, 3
MAX_LEN = 40  # dilated: d = max(1, 40 // kc)
# (pattern, binning); binning only matters with lsh. The last is a 3-way union.
CASES = [
    ("sw", "sign"),
    ("sink", "sign"),
    ("dilated", "sign"),
    ("lsh", "sign"),
    ("lsh", "argmax"),
    ("ks", "sign"),
    ("full", "sign"),
    ("sw+sink", "sign"),
    ("sw+dilated", "sign"),
    ("lsh+ks", "sign"),
    ("lsh+ks", "argmax"),
    ("sw+lsh+ks", "sign"),
]
CASE_IDS = [f"{p}-{b}" if "lsh" in p else p for p, b in CASES]


def make_inputs(l, seed=0, dtype=jnp.float32, hash_bits=H_):
    """Random q, k, v, hash_proj; key_scores are small integers, so ks sees many ties."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape, np.float32)  # noqa: E731
    return dict(
        q=jnp.asarray(normal(B_, l, N_), dtype),
        k=jnp.asarray(normal(B_, l, N_), dtype),
        v=jnp.asarray(normal(B_, l, E_), dtype),
        hash_proj=jnp.asarray(normal(N_, hash_bits)),
        key_scores=jnp.asarray(rng.integers(0, 6, (B_, l)).astype(np.float32), dtype),
    )


def spec_of(pattern, num_keys, binning="sign", hash_bits=H_):
    """The SparseSpec of a test case (max_len = MAX_LEN for dilated)."""
    return SparseSpec(pattern, num_keys, hash_bits=hash_bits, binning=binning, max_len=MAX_LEN)


def assert_close(actual, desired, tol):
    """assert_allclose on fp32 copies."""
    actual, desired = np.asarray(actual, np.float32), np.asarray(desired, np.float32)
    np.testing.assert_allclose(actual, desired, **tol)


@functools.partial(jax.jit, static_argnames=("fn", "with_rows", "spec"))
def _probe(q, k, v, rest, w, *, fn, with_rows, spec):
    """Forward, one vjp and (with_rows) the l one-hot vjps; see `probe`."""
    o, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, **rest, spec=spec).astype(jnp.float32), q, k, v)
    grads = dict(zip("qkv", vjp(w)))
    if not with_rows:
        mask = sparse_attention_mask(q, k, **rest, spec=spec)
        return o, grads, mask
    b, l, e = o.shape
    onehot_ibl1 = jnp.eye(l, dtype=jnp.float32)[:, None, :, None]
    rows = jax.vmap(vjp)(jnp.broadcast_to(onehot_ibl1, (l, b, l, e)))
    return o, grads, dict(zip("qkv", rows))


def probe(fn, inputs, with_rows, spec):
    """(o, grads of a fixed random linear functional of o wrt q, k, v, extra), jitted once per
    (fn, shapes, spec).

    extra: with_rows, rows[name][i] = d sum(o[:, i]) / d name of shape (l, b, l, feature), the
    gradient of query row i at every position (causality, empty rows); else the oracle's mask.
    """
    rest = {name: x for name, x in inputs.items() if name not in ("q", "k", "v")}
    w = jnp.asarray(np.random.default_rng(9).standard_normal(inputs["v"].shape), jnp.float32)
    return _probe(
        inputs["q"],
        inputs["k"],
        inputs["v"],
        rest,
        w,
        fn=fn,
        with_rows=with_rows,
        spec=spec,
    )


def check_against_oracle(pattern, binning, l, num_keys, inputs):
    """Values and gradients equal the oracle; no gradient from the future; rows that select no
    key are 0 with zero gradient. Returns the empty rows (b, l) and o."""
    spec = spec_of(pattern, num_keys, binning, hash_bits=inputs["hash_proj"].shape[1])
    o, grads, rows = probe(sparse_attention, inputs, True, spec)
    o_ref, grads_ref, mask = probe(sparse_attention_reference, inputs, False, spec)
    assert o.shape == (B_, l, E_) and o.dtype == jnp.float32
    assert_close(o, o_ref, TOL[jnp.float32])
    for name in "qkv":
        assert np.all(np.isfinite(grads[name])), name
        assert_close(grads[name], grads_ref[name], GRAD_TOL)
    i_idx, j_idx = np.triu_indices(l, k=1)  # j > i
    empty_bi = ~np.asarray(mask).any(-1)
    assert np.all(np.asarray(o)[empty_bi] == 0)
    for name in "qkv":
        rows_ibjf = np.asarray(rows[name])
        assert np.all(rows_ibjf[i_idx, :, j_idx] == 0), name
        assert np.all(rows_ibjf.transpose(1, 0, 2, 3)[empty_bi] == 0), name
    return empty_bi, o


@pytest.mark.parametrize("pattern, binning", CASES, ids=CASE_IDS)
def test_matches_oracle_and_is_causal(pattern, binning):
    """l = 37: equal to the dense oracle (values, grads); causal; future tokens change nothing."""
    l, num_keys = 37, 12
    inputs = make_inputs(l)
    _, o = check_against_oracle(pattern, binning, l, num_keys, inputs)
    # Changing every token from cut on (q, k, v and key scores) leaves o[:, :cut] unchanged:
    # the lsh centring uses running means, ks a prefix top-k.
    cut = 20
    changed = make_inputs(l, seed=5)
    mixed = {
        name: (
            jnp.concatenate([inputs[name][:, :cut], changed[name][:, cut:]], axis=1)
            if name != "hash_proj"
            else inputs[name]
        )
        for name in inputs
    }
    o_mixed = probe(sparse_attention, mixed, True, spec_of(pattern, num_keys, binning))[0]
    np.testing.assert_array_equal(np.asarray(o_mixed[:, :cut]), np.asarray(o[:, :cut]))


@pytest.mark.parametrize(
    "pattern, binning",
    [("sw", "sign"), ("sw+dilated", "sign"), ("lsh+ks", "argmax"), ("sink+dilated+lsh+ks", "sign")],
)
def test_num_keys_larger_than_l(pattern, binning):
    """l = 100 (not a power of two) with num_keys = 256 > l: still equal to the oracle."""
    check_against_oracle(pattern, binning, 100, 256, make_inputs(100, seed=1))


@pytest.mark.parametrize("pattern", ["sink+dilated", "sw+sink+dilated", "dilated+sink"])
def test_positional_unions_count_each_key_once(pattern):
    """Unions of sw, sink and dilated (no gather: local.py) overlap; each key is counted once."""
    check_against_oracle(pattern, "sign", 37, 12, make_inputs(37, seed=6))


def test_queries_with_no_key_output_zero():
    """lsh alone, built so that some queries' buckets hold no key yet: those rows output exactly
    0 with exactly zero gradient (not a softmax over unselected or future keys)."""
    l = 37
    inputs = make_inputs(l, seed=2, hash_bits=2)
    # Bit 0 hashes feature 0, bit 1 feature 1. Keys' feature 0 falls along the sequence, so
    # its running-mean-centred value is <= 0 and no key ever has bit 0 set: queries with bit 0
    # set (about half, from the random feature 0) have an empty bucket.
    inputs["hash_proj"] = jnp.eye(N_, 2, dtype=jnp.float32)
    inputs["k"] = inputs["k"].at[:, :, 0].set(-0.1 * jnp.arange(l, dtype=jnp.float32))
    bucket_q = lsh_buckets(inputs["q"] - running_mean(inputs["q"]), inputs["hash_proj"], "sign")
    bucket_k = lsh_buckets(inputs["k"] - running_mean(inputs["k"]), inputs["hash_proj"], "sign")
    assert np.all(np.asarray(bucket_k) % 2 == 0)
    empty_bi, _ = check_against_oracle("lsh", "sign", l, 4, inputs)
    assert empty_bi.sum() >= 10 and (~empty_bi).sum() >= 10
    assert np.all(empty_bi[np.asarray(bucket_q) % 2 == 1])


@pytest.mark.parametrize("pattern", ["ks", "lsh+ks"])
def test_keys_scored_minus_inf_are_never_selected(pattern):
    """A key scored -inf is no ks candidate (an empty row: sequence shards put their carried keys
    behind such rows): the first 6 keys and every fifth one. Queries with fewer than kc finite keys
    before them take just those (queries 0 to 5: none)."""
    l, num_keys = 37, 12
    inputs = make_inputs(l, seed=4)
    minus_inf = (np.arange(l) < 6) | (np.arange(l) % 5 == 0)
    inputs["key_scores"] = jnp.where(minus_inf, -jnp.inf, inputs["key_scores"])
    check_against_oracle(pattern, "sign", l, num_keys, inputs)
    spec = spec_of("ks", num_keys)
    mask = np.asarray(sparse_attention_mask(inputs["q"], inputs["k"], spec=spec, **_rest(inputs)))
    assert not mask[:, :, minus_inf].any()
    finite_before = np.cumsum(~minus_inf)  # finite keys at or before each query; kc = 12
    np.testing.assert_array_equal(
        mask.sum(-1), np.broadcast_to(np.minimum(finite_before, 12), mask.shape[:2])
    )


def _rest(inputs):
    """The keyword inputs of an op besides q, k, v."""
    return {name: x for name, x in inputs.items() if name not in ("q", "k", "v")}


def test_dilated_early_queries_are_empty():
    """Dilated with a large stride: queries before the first j = d - 1 select nothing."""
    l = 37
    empty_bi, _ = check_against_oracle("dilated", "sign", l, 4, make_inputs(l, seed=3))
    # kc = 4, d = 40 // 4 = 10: queries 0..8 have no j with j % 10 == 9.
    np.testing.assert_array_equal(empty_bi, np.broadcast_to(np.arange(l) < 9, (B_, l)))


@pytest.mark.parametrize("pattern", ["sw+lsh+ks", "sw"])  # "sw" alone: no gather
def test_bf16_inputs(pattern):
    """bf16 inputs compute in fp32 and come back in bf16, close to the oracle on the same."""
    inputs = make_inputs(37, seed=4, dtype=jnp.bfloat16)
    static = dict(pattern=pattern, num_keys=12, max_len=MAX_LEN, binning="sign")
    o = sparse_attention(**inputs, **static)
    assert o.dtype == jnp.bfloat16
    reference = jax.jit(sparse_attention_reference, static_argnames="spec")
    o_ref = reference(**inputs, spec=SparseSpec(**static, hash_bits=H_))
    assert_close(o, o_ref, TOL[jnp.bfloat16])


@pytest.mark.parametrize("pattern, binning", CASES, ids=CASE_IDS)
def test_step_equals_parallel(pattern, binning):
    """Decoding token by token through the cache (jitted scan of steps) equals the parallel op."""
    l, num_keys = 37, 12
    inputs = make_inputs(l, seed=6)
    spec = spec_of(pattern, num_keys, binning)
    o = probe(sparse_attention, inputs, True, spec)[0]  # compiled by the oracle test
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


# ---- cost: no (l, l) array anywhere in the forward + backward program ----------------------


def _sub_jaxprs(value):
    """Jaxprs inside an equation parameter (ClosedJaxpr, Jaxpr, or tuples / lists of them)."""
    if isinstance(value, jax.extend.core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jax.extend.core.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _sub_jaxprs(item)


def big_shapes(jaxpr, threshold):
    """Shapes of every variable, in jaxpr and all sub-jaxprs (scan, while, cond, pjit,
    custom_vjp, checkpoint, ...), with at least two axes >= threshold."""
    found = []

    def visit(var):
        """Record var if it is large in two axes."""
        shape = getattr(getattr(var, "aval", None), "shape", ())
        if sum(int(d) >= threshold for d in shape) >= 2:
            found.append(tuple(shape))

    def walk(jx):
        """Visit the variables of one jaxpr, then recurse into its equations' sub-jaxprs."""
        for var in (*jx.constvars, *jx.invars, *jx.outvars):
            visit(var)
        for eqn in jx.eqns:
            for var in (*eqn.invars, *eqn.outvars):
                visit(var)
            for param in eqn.params.values():
                for sub in _sub_jaxprs(param):
                    walk(sub)

    walk(jaxpr.jaxpr)
    return found


@pytest.mark.parametrize("pattern", ["lsh+ks", "sw"])
def test_has_no_quadratic_array(pattern):
    """lsh+ks (and sw, blocked) forward + backward at l = 8192 hold no array with two axes >= l /
    2; the same walker finds the (l, l) arrays of the dense oracle, so the check can fail."""
    l = 8192
    rng = np.random.default_rng(7)
    q, k = (jnp.asarray(rng.standard_normal((1, l, 16)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((1, l, 32)), jnp.float32)
    hash_proj = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)
    key_scores = jnp.asarray(rng.standard_normal((1, l)), jnp.float32)

    def jaxpr_of(fn):
        """Jaxpr of the gradient of sum(o) wrt q, k, v."""
        spec = SparseSpec(pattern, 64, hash_bits=8 if "lsh" in pattern else None)
        loss = lambda q, k, v: jnp.sum(  # noqa: E731
            fn(q, k, v, spec=spec, hash_proj=hash_proj, key_scores=key_scores)
        )
        return jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    assert big_shapes(jaxpr_of(sparse_attention), l // 2) == []
    assert (1, l, l) in big_shapes(jaxpr_of(sparse_attention_reference), l // 2)


def test_prefill_cache_has_no_quadratic_array():
    """prefill_cache with lsh+ks at l = 8192 holds no array with two axes >= l / 2."""
    l = 8192
    rng = np.random.default_rng(8)
    q, k = (jnp.asarray(rng.standard_normal((1, l, 16)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((1, l, 32)), jnp.float32)
    hash_proj = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)
    key_scores = jnp.asarray(rng.standard_normal((1, l)), jnp.float32)
    spec = SparseSpec("lsh+ks", 64, hash_bits=8)
    cache = init_cache(1, l, 16, 32, spec=spec)
    jaxpr = jax.make_jaxpr(
        lambda q, k, v: prefill_cache(
            q, k, v, cache, spec=spec, hash_proj=hash_proj, key_scores=key_scores
        )
    )(q, k, v)
    assert big_shapes(jaxpr, l // 2) == []


# ---- official_code=True ---------------------------------------------------------------------


def official_numpy(q, k, v, hash_proj, pattern, num_keys):
    """Direct transcription of the official code for pattern "lsh" or "sw+lsh" (sign binning):
    whole-sequence centring, L2 normalisation over axis 1, the kc most recent same-bucket keys
    j <= i, then an additive finfo.min mask, so a row with no key gets a uniform softmax over
    all positions."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, l, _ = q.shape
    kc = num_keys // len(pattern.split("+"))

    def buckets(x):
        """Sign-bit buckets of the centred, sequence-normalised x."""
        x = x - x.mean(axis=1, keepdims=True)
        x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
        bits = (x @ np.asarray(hash_proj, np.float64)) > 0
        return (bits * (2 ** np.arange(bits.shape[-1]))).sum(-1)

    bucket_q, bucket_k = buckets(q), buckets(k)
    out = np.zeros((b, l, v.shape[-1]))
    for bb in range(b):
        for i in range(l):
            allowed = np.zeros(l, bool)
            if "sw" in pattern:
                allowed[max(0, i - kc + 1) : i + 1] = True
            same = [j for j in range(i + 1) if bucket_k[bb, j] == bucket_q[bb, i]]
            allowed[same[len(same) - kc :] if len(same) > kc else same] = True
            logits = q[bb, i] @ k[bb].T + np.where(allowed, 0.0, np.finfo(np.float32).min)
            p = np.exp(logits - logits.max())
            out[bb, i] = (p / p.sum()) @ v[bb]
    return out


@pytest.mark.parametrize(
    "pattern, seed, hash_bits, num_keys",
    [("lsh", 8, 1, 2), ("sw+lsh", 8, 1, 6), ("sw+lsh", 9, 3, 8)],
)
def test_official_code_matches_transcription(pattern, seed, hash_bits, num_keys):
    """official_code=True equals the dense transcription of the official code; with one hash
    bit, the first half of the queries select no key and get the mean of ALL values."""
    l = 24
    inputs = make_inputs(l, seed=seed, hash_bits=hash_bits)
    if hash_bits == 1:
        # Bit 0 hashes feature 0; keys rise and queries fall along the sequence, so after
        # whole-sequence centring queries 0..11 are in bucket 1 and keys 0..11 in bucket 0.
        inputs["hash_proj"] = jnp.eye(N_, 1, dtype=jnp.float32)
        ramp = jnp.arange(l, dtype=jnp.float32)
        inputs["k"] = inputs["k"].at[:, :, 0].set(ramp)
        inputs["q"] = inputs["q"].at[:, :, 0].set(-ramp)
    args = (inputs["q"], inputs["k"], inputs["v"])
    o = sparse_attention(
        *args, pattern=pattern, num_keys=num_keys, hash_proj=inputs["hash_proj"], official_code=True
    )
    assert_close(o, official_numpy(*args, inputs["hash_proj"], pattern, num_keys), TOL[jnp.float32])
    if pattern == "lsh":
        v_mean_be = np.asarray(inputs["v"]).mean(axis=1)
        assert_close(
            o[:, : l // 2], np.broadcast_to(v_mean_be[:, None], (B_, l // 2, E_)), TOL[jnp.float32]
        )


# ---- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(pattern=""), "pattern must be a non-empty"),
        (dict(pattern="sw+window"), "unknown component 'window' in pattern 'sw\\+window'"),
        (dict(pattern="sw+ks+sw"), "component 'sw' repeated in pattern 'sw\\+ks\\+sw'"),
        (dict(pattern="full+sw"), "'full' cannot be combined with other components: 'full\\+sw'"),
        (dict(pattern="sw+sink+ks", num_keys=2), "num_keys = 2 is smaller than the 3 components"),
        (dict(num_keys=0), "num_keys must be a positive int, got 0"),
        (dict(num_keys=4.0), "num_keys must be a positive int, got 4.0"),
        (dict(binning="round"), "binning must be one of .*, got 'round'"),
        (
            dict(pattern="lsh", hash_proj=None),
            "hash_bits \\(h of hash_proj \\(n, h\\)\\) is required",
        ),
        (
            dict(pattern="lsh", hash_proj=jnp.zeros((N_ + 1, 3))),
            "hash_proj must have shape \\(n, h\\) = \\(8, 3\\), got \\(9, 3\\)",
        ),
        (
            dict(pattern="lsh", hash_proj=jnp.zeros((N_, 31))),
            "at most 30 hash bits, got hash_bits = 31",
        ),
        (dict(pattern="ks", key_scores=None), "key_scores \\(b, l\\) is required by 'ks'"),
        (dict(pattern="ks", key_scores=jnp.zeros((B_, 6))), "key_scores must have shape"),
        (dict(pattern="dilated", max_len=None), "max_len is required by 'dilated'"),
        (dict(pattern="dilated", max_len=-3), "max_len must be a positive int, got -3"),
        (dict(k=jnp.zeros((B_, 7, N_))), "k must have shape \\(b, l, n\\) = \\(2, 5, 8\\)"),
        (dict(v=jnp.zeros((B_, 7, E_))), "v must have shape \\(b, l, e\\) with \\(b, l\\)"),
        (dict(q=jnp.zeros((B_, 5))), "q must have shape \\(b, l, n\\), got \\(2, 5\\)"),
        (dict(v=jnp.zeros((B_, 5, E_), jnp.int32)), "v must have a floating dtype"),
    ],
)
def test_bad_arguments_raise(change, match):
    """Bad patterns, budgets, shapes and missing inputs raise ValueError naming the value."""
    args = dict(make_inputs(5), pattern="sw+lsh+ks", num_keys=6, max_len=8, binning="sign")
    args.update(change)
    with pytest.raises(ValueError, match=match):
        sparse_attention(**args)


def test_spec_derives_and_drops_unused_settings():
    """The spec's derived sizes; settings its pattern does not read are dropped, so that specs of
    one attention are equal and hash alike (one jit cache entry)."""
    spec = SparseSpec("sw+lsh+dilated", 13, hash_bits=3, binning="argmax", max_len=40)
    assert spec.components == ("sw", "lsh", "dilated") and spec.has("lsh") and not spec.has("ks")
    assert (spec.keys_per_component, spec.num_buckets, spec.dilation) == (4, 3, 10)
    assert SparseSpec("lsh", 4, hash_bits=3).num_buckets == 8
    plain = SparseSpec("sw", 4)
    assert SparseSpec("sw", 4, hash_bits=8, max_len=1058) == plain
    assert hash(SparseSpec("sw", 4, hash_bits=8, max_len=1058)) == hash(plain)


def test_spec_or_settings_not_both():
    """The op takes the attention as a spec or as loose settings; both at once is refused, naming
    the settings given beside the spec; the spec alone gives what its settings give."""
    inputs = make_inputs(5)
    spec = SparseSpec("sw+lsh+ks", 6, hash_bits=H_)
    with pytest.raises(ValueError, match="not both: {'num_keys': 6}"):
        sparse_attention(**inputs, spec=spec, num_keys=6)
    with pytest.raises(ValueError, match="spec must be a SparseSpec, got str"):
        sparse_attention(**inputs, spec="sw+lsh+ks")
    loose = sparse_attention(**inputs, pattern="sw+lsh+ks", num_keys=6)
    np.testing.assert_array_equal(np.asarray(sparse_attention(**inputs, spec=spec)), loose)


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
