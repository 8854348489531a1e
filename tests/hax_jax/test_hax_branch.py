"""The HAX branch in both mixers: step == parallel, causality, the ranking loss, rng behaviour, qk
init."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from mixer_testing import (
    lm_logits,
    lm_prefill_then_decode,
    perturbed,
    random_inputs,
    run_parallel,
    run_step,
)

from hax_jax.config import Mamba2Config, MambaConfig, ModelConfig, SparseConfig
from hax_jax.layers.hax_attention import HaxBranch, init_qk_from_bc, ranking_loss
from hax_jax.models.blocks import MIXERS
from hax_jax.models.lm import LanguageModel, rank_loss_sum

TOL = dict(atol=2e-5, rtol=2e-5)  # fp32
PATTERNS = ["lsh+ks", "lsh", "ks", "sw+sink", "sw+dilated", "full"]
CAPACITY = 32  # small: the step scan of "full" reads every row of the cache per token


def _cfg(kind: str, pattern: str, **sparse) -> ModelConfig:
    """A small mixer with the branch on; few keys so that selection really is sparse at l = 29."""
    return ModelConfig(
        d_model=16,
        n_layer=2,
        vocab_size=40,
        block_pattern=(kind,),
        mamba=MambaConfig(d_state=8),
        mamba2=Mamba2Config(d_state=8, headdim=8, chunk_size=8),
        sparse=SparseConfig(pattern=pattern, num_keys=8, hash_bits=3, max_len=32, **sparse),
    )


def _mixer(kind: str, pattern: str, seed: int = 0, **sparse):
    """A mixer whose parameters are moved off their init (E = 1, D = 1 ... would hide mistakes)."""
    return perturbed(
        MIXERS[kind](_cfg(kind, pattern, **sparse), rngs=nnx.Rngs(seed)), seed=seed + 7, scale=0.2
    )


def _record_paths(monkeypatch) -> list:
    """Record the path HaxBranch.forward takes from a cache, per trace: "prefill" (parallel) or
    "scan" (the step over every token)."""
    calls = []
    for name in ("prefill", "scan"):
        original = getattr(HaxBranch, name)

        def recorded(self, *args, _name=name, _original=original):
            """Note the path, then take it."""
            calls.append(_name)
            return _original(self, *args)

        monkeypatch.setattr(HaxBranch, name, recorded)
    return calls


def _assert_sparse_caches_equal(actual, desired):
    """Every field of two SparseAttentionCaches: positions exactly; keys, values, sums and scores
    (projected and summed in another order) to rounding."""
    for name in desired._fields:
        a, d = np.asarray(getattr(actual, name)), np.asarray(getattr(desired, name))
        assert (a.shape, a.dtype) == (d.shape, d.dtype), name
        if a.dtype.kind == "f":
            np.testing.assert_allclose(a, d, **TOL, err_msg=name)
        else:
            np.testing.assert_array_equal(a, d, err_msg=name)


@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_step_equals_parallel(kind, pattern, monkeypatch):
    _check_step_equals_parallel(_mixer(kind, pattern), monkeypatch)


def test_step_kernel_equals_parallel(monkeypatch):
    """impl="pallas": the parallel op's kernels and the decode step's kernels (decode_pallas.py),
    interpreted here (one mixer kind: both call the branch's step alike)."""
    _check_step_equals_parallel(_mixer("mamba2", "lsh+ks", impl="pallas"), monkeypatch)


def _check_step_equals_parallel(mixer, monkeypatch):
    """A prefill of 9 tokens, then one token at a time, equals the parallel op on all 29."""
    u = random_inputs(l=29, d=16)
    full, _ = run_parallel(mixer, u)  # the sub-quadratic parallel op
    calls = _record_paths(monkeypatch)
    # A prefill from a cache made inside the jit (fresh: the parallel path), then one token at a
    # time. (jitted here, not at module level, so that every test traces and records its path.)
    prefill = nnx.jit(lambda mixer, u: mixer(u, cache=mixer.init_cache(u.shape[0], CAPACITY)))
    y, cache = prefill(mixer, u[:, :9])
    assert calls == ["prefill"]
    decoded = [y]
    for t in range(9, u.shape[1]):
        y_t, cache = run_step(mixer, u[:, t], cache)
        decoded.append(y_t[:, None])
    np.testing.assert_allclose(jnp.concatenate(decoded, 1), full, **TOL)


@pytest.mark.parametrize("pattern", ["lsh+ks", "ks", "sw+dilated"])
def test_fresh_prefill_equals_the_step_scan(pattern, monkeypatch):
    """The branch's parallel prefill from a fresh cache (made inside the jit: t concretely 0)
    gives the step scan's outputs and cache; a cache passed into the jit (t traced, so not known
    to be fresh) still takes the scan."""
    mixer = _mixer("mamba2", pattern)
    x = random_inputs(l=29, d=mixer.d_inner, seed=1)
    calls = _record_paths(monkeypatch)

    @nnx.jit
    def both(mixer, x, passed):
        """(fresh prefill, prefill from the passed cache)."""
        fresh = mixer.branch.forward(x, mixer.init_cache(x.shape[0], CAPACITY))
        return fresh, mixer.branch.forward(x, passed)

    (o, cache), (o_scan, cache_scan) = both(mixer, x, mixer.init_cache(x.shape[0], CAPACITY))
    assert calls == ["prefill", "scan"]
    np.testing.assert_allclose(o, o_scan, **TOL)
    _assert_sparse_caches_equal(cache, cache_scan)


def test_chunked_prefill_continues_with_the_step_scan(monkeypatch):
    """A prefill of 9 tokens from a fresh cache (parallel), then 7 more from the cache it returns
    (not fresh: the step scan) equals one fresh prefill of all 16, outputs and cache."""
    mixer = _mixer("mamba2", "lsh+ks")
    u = random_inputs(l=16, d=16, seed=2)
    calls = _record_paths(monkeypatch)

    @nnx.jit
    def prefills(mixer, u):
        """(9 then 7 tokens, all 16 at once), each as (y, cache)."""
        y_a, cache = mixer(u[:, :9], cache=mixer.init_cache(u.shape[0], CAPACITY))
        y_b, cache = mixer(u[:, 9:], cache=cache)
        whole = mixer(u, cache=mixer.init_cache(u.shape[0], CAPACITY))
        return (jnp.concatenate([y_a, y_b], 1), cache), whole

    (y, cache), (y_whole, cache_whole) = prefills(mixer, u)
    assert calls == ["prefill", "scan", "prefill"]
    np.testing.assert_allclose(y, y_whole, **TOL)
    for a, d in zip(cache[:-1], cache_whole[:-1]):  # conv and SSM states
        np.testing.assert_allclose(a, d, **TOL)
    _assert_sparse_caches_equal(cache.sparse, cache_whole.sparse)


def test_prefill_past_capacity_raises():
    """A prompt longer than the cache's capacity is a ValueError naming both (the step scan
    would give NaN from there on)."""
    mixer = _mixer("mamba2", "lsh+ks")
    x = random_inputs(l=9, d=mixer.d_inner)
    with pytest.raises(ValueError, match="l = 9 tokens after t = 0 .* capacity = 8"):
        mixer.branch.forward(x, mixer.init_cache(x.shape[0], 8))


# Training mode resamples the LSH hash and sows the ks ranking loss; without lsh or ks it computes
# what eval mode does, so those patterns run once.
LEAKAGE_CASES = [
    (pattern, training)
    for pattern in PATTERNS
    for training in ((False, True) if "lsh" in pattern or "ks" in pattern else (True,))
]


@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
@pytest.mark.parametrize(
    "pattern, training",
    LEAKAGE_CASES,
    ids=[f"{'train' if t else 'eval'}-{p}" for p, t in LEAKAGE_CASES],
)
def test_no_future_leakage(kind, pattern, training):
    """Gradients see leaks through the attention weights; changed futures see leaks through the
    (discrete, gradient-free) selection of keys."""
    graphdef, state = nnx.split(_mixer(kind, pattern))
    u = random_inputs(b=1, l=29, d=16)
    rng = jax.random.key(3) if training else None

    @jax.jit
    def out(u):
        # Training mode sows the ranking loss, which only nnx.capture may collect.
        (y, _), _ = nnx.capture(nnx.merge(graphdef, state), nnx.Intermediate)(u, rng=rng)
        return y

    # One program for both positions' gradients (i is traced).
    grad_at = jax.jit(jax.grad(lambda u, i: jnp.sum(out(u)[:, i])))
    for i in (4, 17):
        grad = grad_at(u, i)
        assert np.all(np.asarray(grad[:, i + 1 :]) == 0.0), (pattern, i)
        assert np.any(np.asarray(grad[:, : i + 1]) != 0.0)
        changed = u.at[:, i + 1 :].set(jax.random.normal(jax.random.key(i), u[:, i + 1 :].shape))
        np.testing.assert_array_equal(out(changed)[:, : i + 1], out(u)[:, : i + 1])


def test_official_code_option_leaks_the_future():
    """The official code centres and normalises over the whole sequence: early outputs depend on
    later tokens (through which keys are selected), where ours do not."""
    u = random_inputs(b=1, l=29, d=16)
    changed = u.at[:, 12:].set(jax.random.normal(jax.random.key(9), u[:, 12:].shape))
    for official, leaks in ((True, True), (False, False)):
        mixer = _mixer("mamba2", "lsh+ks", official_code=official)
        before, after = run_parallel(mixer, u)[0][:, :12], run_parallel(mixer, changed)[0][:, :12]
        assert bool(np.any(np.asarray(before) != np.asarray(after))) == leaks
    mixer = _mixer("mamba2", "lsh+ks", official_code=True)
    with pytest.raises(ValueError, match="official_code=True is non-causal"):
        mixer.step(u[:, 0], mixer.init_cache(1))


def _ranking_loss_transcribed(x, q, k, candidates):
    """Paper eqs. 15-17 written out with loops, for one sequence."""
    c = len(candidates)
    y = [sum(1 / (1 + np.exp(-q[i] @ k[j])) for i in range(len(q)) if i >= j) for j in candidates]
    xs = [x[j] for j in candidates]
    total = 0.0
    for a in range(c):
        for b in range(c):
            p = xs[a] - xs[b]
            t = 1.0 if y[a] > y[b] else (0.5 if y[a] == y[b] else 0.0)
            sig = 1 / (1 + np.exp(-p))
            total += -(t * np.log(sig) + (1 - t) * np.log(1 - sig))
    return total / c**2


def test_ranking_loss_equals_the_paper():
    rng = np.random.default_rng(0)
    l, n = 11, 4
    x, q, k = rng.normal(size=(2, l)), rng.normal(size=(2, l, n)), rng.normal(size=(2, l, n))
    candidates = np.array([[0, 3, 7, 10], [2, 5, 6, 9]])
    # A duplicated target (equal y) must give T = 0.5: make keys 5 and 6 of row 1 equal and last.
    k[1, 6] = k[1, 5]
    q[1, 6:] = 0.0
    ours = ranking_loss(jnp.asarray(x), jnp.asarray(q), jnp.asarray(k), jnp.asarray(candidates))
    want = np.mean([_ranking_loss_transcribed(x[i], q[i], k[i], candidates[i]) for i in range(2)])
    np.testing.assert_allclose(ours, want, rtol=1e-5)


@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_rank_loss_is_sown_in_training_and_trains_only_the_scorer(kind):
    mixer = _mixer(kind, "lsh+ks")
    u = random_inputs(l=29, d=16)
    graphdef, params = nnx.split(mixer, nnx.Param)

    def rank_loss(params):
        _, sown = nnx.capture(nnx.merge(graphdef, params), nnx.Intermediate)(
            u, rng=jax.random.key(1)
        )
        return rank_loss_sum(sown)

    loss, grads = jax.value_and_grad(rank_loss)(params)
    assert np.isfinite(loss) and loss > 0
    flat = {
        "/".join(map(str, p)): g
        for p, g in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(grads))[0]
    }
    moved = {name for name, g in flat.items() if np.any(np.asarray(g) != 0)}
    assert moved and all("scorer" in name for name in moved), moved
    _, sown = nnx.capture(mixer, nnx.Intermediate)(u)  # evaluation sows nothing
    assert not jax.tree.leaves(sown)


def test_hash_is_resampled_in_training_and_fixed_in_eval():
    mixer = _mixer("mamba", "lsh")
    u = random_inputs(l=29, d=16)
    a, b = (
        run_parallel(mixer, u, rng=jax.random.key(1))[0],
        run_parallel(mixer, u, rng=jax.random.key(2))[0],
    )
    assert not np.allclose(a, b)
    np.testing.assert_array_equal(run_parallel(mixer, u)[0], run_parallel(mixer, u)[0])


def test_padding_is_never_a_rank_candidate():
    mixer = _mixer("mamba", "ks")
    u = random_inputs(b=1, l=29, d=16)
    mask = jnp.arange(29)[None] < 6  # 6 real tokens, fewer than kc = 8 candidates
    with_mask = rank_loss_sum(
        nnx.capture(mixer, nnx.Intermediate)(u, mask=mask, rng=jax.random.key(0))[1]
    )
    assert np.isfinite(with_mask) and with_mask > 0
    # Candidates are sampled among the 6 real positions only: padding rows change nothing.
    padded = u.at[:, 6:].set(100.0)
    again = rank_loss_sum(
        nnx.capture(mixer, nnx.Intermediate)(padded, mask=mask, rng=jax.random.key(0))[1]
    )
    np.testing.assert_allclose(again, with_mask, **TOL)


def test_qk_projection_from_pretrained_b_c():
    cfg = _cfg("mamba", "lsh+ks")
    mixer = MIXERS["mamba"](cfg, rngs=nnx.Rngs(0))
    kernel = mixer.x_proj.kernel[...]
    r, n = mixer.dt_rank, mixer.d_state
    mixer.branch.qk_proj.kernel[...] = init_qk_from_bc(kernel, dt_rank=r, d_state=n)
    x = jax.random.normal(jax.random.key(0), (3, mixer.d_inner))
    k, q = jnp.split(mixer.branch.qk_proj(x), 2, axis=-1)
    _, B, C = jnp.split(mixer.x_proj(x), [r, r + n], axis=-1)
    np.testing.assert_allclose(k, B, **TOL)
    np.testing.assert_allclose(q, C, **TOL)


def test_hax_lm_trains_and_decodes():
    cfg = dataclasses.replace(_cfg("mamba2", "lsh+ks"), block_pattern=("mamba2", "mamba"))
    model = LanguageModel(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(0), (2, 15), 0, cfg.vocab_size)
    graphdef, state = nnx.split(model)
    # Jitted: dispatching the model's ops one by one took longer than compiling it on CPU.
    train = jax.jit(
        lambda state, tokens: nnx.capture(nnx.merge(graphdef, state), nnx.Intermediate)(
            tokens, rng=jax.random.key(0)
        )
    )
    _, sown = train(state, tokens)
    assert len(jax.tree.leaves(sown)) == cfg.n_layer and rank_loss_sum(sown) > 0
    full = lm_logits(model, tokens)
    decoded, _ = lm_prefill_then_decode(model, tokens, prefix=5, cache=model.init_cache(2))
    np.testing.assert_allclose(decoded, full, **TOL)
    forward = jax.jit(lambda state, tokens: nnx.merge(graphdef, state).forward(tokens))
    with pytest.raises(ValueError, match="start from model.init_cache"):
        _, no_branch_cache = forward(state, tokens[:, :5])
        model.step(tokens[:, 5], no_branch_cache)
