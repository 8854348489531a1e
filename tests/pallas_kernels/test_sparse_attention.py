"""Tests for HAX sparse attention: indexed op == dense oracle, causality, cost, errors (decoding:
test_sparse_decode.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxprs import sub_jaxprs
from sparse_cases import (
    B_,
    CASE_IDS,
    CASES,
    E_,
    GRAD_TOL,
    H_,
    MAX_LEN,
    N_,
    TOL,
    assert_close,
    make_inputs,
    probe,
    spec_of,
)

from pallas_kernels.sparse_attention import (
    SparseSpec,
    init_cache,
    lsh_buckets,
    prefill_cache,
    running_mean,
    sparse_attention,
    sparse_attention_mask,
    sparse_attention_reference,
)

jax.config.update("jax_enable_x64", False)


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


# ---- cost: no (l, l) array anywhere in the forward + backward program ----------------------


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
            for sub in sub_jaxprs(eqn):
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
