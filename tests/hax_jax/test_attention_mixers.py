"""Attention, sliding-window attention, SwiGLU and Infini-attention mixers, and a Samba-style LM."""

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from mixer_testing import (
    assert_lm_decode_equals_parallel,
    assert_trees_close,
    perturbed_mixer,
    prefill_then_decode,
    random_inputs,
    run_parallel,
)

from hax_jax.config import AttentionConfig, InfiniConfig, MambaConfig, MlpConfig, ModelConfig
from hax_jax.layers.infini import memory_retrieve, memory_update, sigma
from hax_jax.models.blocks import MIXERS

TOL = {jnp.float32: dict(atol=2e-5, rtol=2e-5), jnp.bfloat16: dict(atol=5e-2, rtol=5e-2)}
WINDOW, SEGMENT = 5, 6  # small, so short sequences cross several windows / segments
VARIANTS = {  # variant -> (mixer kind, config overrides)
    "attention": ("attention", {}),
    "swa": ("swa", {}),
    "mlp": ("mlp", {}),
    "infini-linear": ("infini", dict(infini=InfiniConfig(segment_len=SEGMENT, update="linear"))),
    "infini-delta": ("infini", dict(infini=InfiniConfig(segment_len=SEGMENT, update="delta"))),
}
CACHED = ["attention", "swa", "infini-linear", "infini-delta"]
_update = jax.jit(memory_update, static_argnums=4)  # eager op-by-op dispatch is slow on CPU


def _cfg(kind: str, **kw) -> ModelConfig:
    """A small config of one mixer kind (qkv biases on, so they are tested too)."""
    base = dict(
        d_model=32,
        n_layer=2,
        vocab_size=50,
        block_pattern=(kind,),
        attention=AttentionConfig(n_heads=4, window=WINDOW, qkv_bias=True),
        mlp=MlpConfig(d_ff=64),
    )
    return ModelConfig(**{**base, **kw})


def _mixer(variant: str, seed: int = 0, **kw):
    """A mixer with every parameter moved off its init, so structure cannot hide errors."""
    kind, overrides = VARIANTS[variant]
    return perturbed_mixer(kind, _cfg(kind, **{**overrides, **kw}), seed)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_step_equals_parallel(variant):
    mixer = _mixer(variant)
    u = random_inputs()
    full, final_cache = run_parallel(mixer, u)
    # Prefill 7 tokens in parallel (past a window and a segment), then decode one token at a time.
    decoded, cache = prefill_then_decode(mixer, u, prefix=7)
    np.testing.assert_allclose(decoded, full, **TOL[jnp.float32])
    assert_trees_close(cache, final_cache, TOL[jnp.float32])


@pytest.mark.parametrize("variant", CACHED)
def test_pieces_equal_whole(variant):
    mixer = _mixer(variant)
    u = random_inputs(l=23)
    full, final_cache = run_parallel(mixer, u)
    cache, outs = None, []
    # Pieces shorter and longer than a window / segment, starting mid-segment, and one (5 -> 12)
    # that ends exactly where the parallel mode's padded segment grid ends.
    for lo, hi in ((0, 5), (5, 12), (12, 14), (14, 23)):
        y, cache = run_parallel(mixer, u[:, lo:hi], cache)
        outs.append(y)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, **TOL[jnp.float32])
    assert_trees_close(cache, final_cache, TOL[jnp.float32])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_causal(variant):
    """d out_i / d u_j == 0 exactly for j > i (and, for swa, for j <= i - window)."""
    mixer = _mixer(variant)
    u = random_inputs(b=1, l=16)
    i = 9  # mid second segment: the memory path is live
    grad = np.asarray(nnx.jit(jax.grad(lambda u, m: jnp.sum(m(u)[0][:, i])))(u, mixer))
    assert np.all(grad[:, i + 1 :] == 0.0)
    assert np.any(grad[:, i] != 0.0)
    if variant == "mlp":
        assert np.all(grad[:, :i] == 0.0)
    elif variant == "swa":
        assert np.all(grad[:, : i - WINDOW + 1] == 0.0)
        assert np.all(np.any(grad[:, i - WINDOW + 1 : i + 1] != 0.0, axis=-1))
    else:
        assert np.all(np.any(grad[:, : i + 1] != 0.0, axis=-1))


@pytest.mark.parametrize("variant", ["attention", "swa", "infini-linear"])
def test_rejects_seq_idx(variant):
    with pytest.raises(ValueError, match=f"{VARIANTS[variant][0]} mixer does not support seq_idx"):
        _mixer(variant)(random_inputs(), seq_idx=jnp.zeros((2, 19), jnp.int32))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_bfloat16_compute_close_to_float32(variant):
    u = random_inputs()
    y32, _ = run_parallel(_mixer(variant), u)
    y16, _ = run_parallel(_mixer(variant, dtype="bfloat16"), u.astype(jnp.bfloat16))
    assert y16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y16, np.float32), y32, **TOL[jnp.bfloat16])


def _np(p) -> np.ndarray:
    """A parameter as float64 numpy."""
    return np.asarray(p[...], np.float64)


def _linear(lin, x: np.ndarray) -> np.ndarray:
    """An nnx.Linear in float64."""
    return x @ _np(lin.kernel) + (0.0 if lin.bias is None else _np(lin.bias))


def _heads(lin, x: np.ndarray, h: int) -> np.ndarray:
    """Projection split into heads: (b, l, h, d)."""
    y = _linear(lin, x)
    return y.reshape(*y.shape[:-1], h, -1)


def _rope(x: np.ndarray, pos: np.ndarray, theta: float) -> np.ndarray:
    """Rotate-half RoPE of x (b, l, h, d) at positions (l,)."""
    half = x.shape[-1] // 2
    ang = pos[:, None] * theta ** (-np.arange(half) * 2.0 / x.shape[-1])
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def _softmax_attention(q, k, v, allowed) -> np.ndarray:
    """Dense masked softmax attention, (b, l, h, d), scale 1/sqrt(d)."""
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    logits = np.where(allowed, logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", probs / probs.sum(-1, keepdims=True), v)


def _attention_reference(mixer, x: np.ndarray, window: int | None) -> np.ndarray:
    """Full or banded attention, dense over (l, l), from the mixer's parameters."""
    h, theta, l = mixer.n_heads, mixer.theta, x.shape[1]
    pos = np.arange(l)
    q, k, v = (_heads(p, x, h) for p in (mixer.q_proj, mixer.k_proj, mixer.v_proj))
    i, j = pos[:, None], pos[None]
    allowed = (j <= i) & ((i - j < window) if window else True)
    o = _softmax_attention(_rope(q, pos, theta), _rope(k, pos, theta), v, allowed)
    return _linear(mixer.o_proj, o.reshape(*x.shape[:2], -1))


@pytest.mark.parametrize("variant, l", [("attention", 19), ("swa", 19), ("swa", 20), ("swa", 3)])
def test_attention_equals_dense_reference(variant, l):
    """swa == attention restricted to the band i - window < j <= i; attention == full causal."""
    mixer = _mixer(variant)
    u = random_inputs(l=l)
    y, _ = run_parallel(mixer, u)
    window = WINDOW if variant == "swa" else None
    want = _attention_reference(mixer, np.asarray(u, np.float64), window)
    np.testing.assert_allclose(y, want, **TOL[jnp.float32])


def _infini_reference(mixer, x: np.ndarray, rule: str):
    """Infini-attention by the formulas, one Python iteration per segment; -> (y, M, z) where M, z
    have absorbed the complete segments."""
    h, n, theta = mixer.n_heads, mixer.seg, mixer.theta
    q, k, v = (_heads(p, x, h) for p in (mixer.q_proj, mixer.k_proj, mixer.v_proj))
    b, l, _, d = q.shape
    mem, norm = np.zeros((b, h, d, d)), np.zeros((b, h, d))
    gate = 1.0 / (1.0 + np.exp(-_np(mixer.beta)))[:, None]
    outs = []
    for s in range(0, l, n):
        Q, K, V = q[:, s : s + n], k[:, s : s + n], v[:, s : s + n]
        sq, sk = (np.where(t > 0, t + 1, np.exp(np.minimum(t, 0))) for t in (Q, K))  # ELU + 1
        a_mem = np.einsum("bnhk,bhkv->bnhv", sq, mem)
        a_mem = a_mem / (np.einsum("bnhk,bhk->bnh", sq, norm) + 1e-6)[..., None]
        pos = np.arange(Q.shape[1])
        causal = pos[None] <= pos[:, None]
        a_dot = _softmax_attention(_rope(Q, pos, theta), _rope(K, pos, theta), V, causal)
        outs.append(gate * a_mem + (1 - gate) * a_dot)
        if Q.shape[1] == n:
            if rule == "delta":
                V = (
                    V
                    - np.einsum("bnhk,bhkv->bnhv", sk, mem)
                    / (np.einsum("bnhk,bhk->bnh", sk, norm) + 1e-6)[..., None]
                )
            mem = mem + np.einsum("bnhk,bnhv->bhkv", sk, V)
            norm = norm + sk.sum(1)
    y = _linear(mixer.o_proj, np.concatenate(outs, 1).reshape(b, l, -1))
    return y, mem, norm


@pytest.mark.parametrize("variant", ["infini-linear", "infini-delta"])
def test_infini_scan_equals_segment_loop(variant):
    mixer = _mixer(variant)
    u = random_inputs(l=4 * SEGMENT - 1)  # the last segment is padded
    y, cache = run_parallel(mixer, u)
    want, mem, norm = _infini_reference(mixer, np.asarray(u, np.float64), mixer.rule)
    np.testing.assert_allclose(y, want, **TOL[jnp.float32])
    np.testing.assert_allclose(cache.mem, mem, **TOL[jnp.float32])
    np.testing.assert_allclose(cache.norm, norm, **TOL[jnp.float32])
    assert int(cache.pos) == u.shape[1]
    # The compressive memory of a layer: H * d_key * (d_value + 1) fp32 numbers per sequence.
    h, dk = mixer.n_heads, mixer.head_dim
    assert cache.mem[0].size + cache.norm[0].size == h * dk * (dk + 1)
    assert cache.mem.dtype == cache.norm.dtype == jnp.float32


def test_infini_delta_rule_does_not_rewrite_existing_bindings():
    b, n, h, d, keys = 2, 3, 2, 4, jax.random.split(jax.random.key(0), 4)
    v = jax.random.normal(keys[0], (b, n, h, d))
    # Keys whose features barely overlap: sigma(K) ~ 2 on one coordinate each, ~e^-40 elsewhere.
    k = jnp.where(jnp.eye(n, d, dtype=bool)[None, :, None], 1.0, -40.0) * jnp.ones((b, n, h, d))
    sk = sigma(k)
    empty_mem, empty_norm = jnp.zeros((b, h, d, d)), jnp.zeros((b, h, d))
    m1, z1 = _update(empty_mem, empty_norm, sk, v, "delta")
    m2, z2 = _update(m1, z1, sk, v, "delta")
    np.testing.assert_allclose(m2, m1, **TOL[jnp.float32])  # the same segment twice: M unchanged
    np.testing.assert_allclose(z2, 2 * z1, **TOL[jnp.float32])  # z counts both writes
    lin1, lz1 = _update(empty_mem, empty_norm, sk, v, "linear")
    lin2, _ = _update(lin1, lz1, sk, v, "linear")
    np.testing.assert_allclose(lin2, 2 * lin1, **TOL[jnp.float32])  # the linear rule adds it again
    # Any memory: writing the values it already returns for these keys is a no-op.
    mem = jax.random.normal(keys[1], (b, h, d, d))
    norm = jax.random.uniform(keys[2], (b, h, d), minval=0.5, maxval=2.0)
    sk = sigma(jax.random.normal(keys[3], (b, n, h, d)))
    same, _ = _update(mem, norm, sk, memory_retrieve(sk, mem, norm), "delta")
    np.testing.assert_allclose(same, mem, **TOL[jnp.float32])


def _big_arrays(jaxpr, n: int) -> list:
    """(primitive, shape) of every value in `jaxpr` and in its sub-jaxprs (scan bodies, remat,
    custom rules, branches: any jaxpr among the equation parameters) with two axes >= n."""
    found = []
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            if sum(s >= n for s in getattr(var.aval, "shape", ())) >= 2:
                found.append((eqn.primitive.name, var.aval.shape))
        for param in jax.tree.leaves(eqn.params):  # Jaxpr / ClosedJaxpr are leaves
            if isinstance(param, (jex.Jaxpr, jex.ClosedJaxpr)):
                found += _big_arrays(getattr(param, "jaxpr", param), n)
    return found


@pytest.mark.parametrize("variant", ["swa", "attention"])
def test_swa_never_builds_a_quadratic_array(variant):
    """swa's forward + backward at l = 4096, window 64, holds no (l/2 x l/2)-sized array; the dense
    attention does (so the walker can see one)."""
    l = 4096
    kind, _ = VARIANTS[variant]
    cfg = _cfg(kind, attention=AttentionConfig(n_heads=4, window=64))
    graphdef, params = nnx.split(MIXERS[kind](cfg, rngs=nnx.Rngs(0)))

    def loss(params, u):
        return jnp.sum(nnx.merge(graphdef, params)(u)[0] ** 2)

    u = jax.ShapeDtypeStruct((1, l, cfg.d_model), jnp.float32)
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(params, u)
    found = _big_arrays(jaxpr.jaxpr, l // 2)
    assert (not found) if variant == "swa" else found, found[:5]


def test_samba_lm_decode_equals_parallel():
    cfg = _cfg(
        "mamba",
        block_pattern=("mamba", "mlp", "swa", "mlp"),
        n_layer=4,
        tie_embeddings=False,
        mamba=MambaConfig(d_state=8, d_conv=4),
        attention=AttentionConfig(n_heads=4, window=4),
    )
    assert_lm_decode_equals_parallel(cfg, TOL[jnp.float32])
