"""The decode step as Pallas kernels (decode_pallas.py): token by token it gives the dense
definition's outputs (reference.py, the paper's masks) and the plain-JAX step's cache
(decode.step_arrays), interpreted on CPU and compiled on a GPU; it cross-lowers for CUDA at the
HAX 130M shapes; impl chooses it, and refuses what it cannot run."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_checks import COMPILED, assert_close
from sparse_cases import TOL, make_inputs

from pallas_kernels import backend
from pallas_kernels.backend import lower_for
from pallas_kernels.sparse_attention import (
    LinearScore,
    SparseSpec,
    init_cache,
    sparse_attention_reference,
    sparse_attention_step,
)
from pallas_kernels.sparse_attention.decode import step_arrays
from pallas_kernels.sparse_attention.decode_pallas import step_pallas, unsupported
from pallas_kernels.sparse_attention.ops import picks_step_pallas

B, N, E, H = 2, 8, 48, 3  # e = 48: three value chunks of 16
# Patterns with 12 keys: kc = 12, 6 or 4 (slots padded to 16), every component, both binnings.
CASES = [
    ("lsh", "sign"),
    ("ks", "sign"),
    ("sw+sink", "sign"),
    ("sw+dilated", "sign"),
    ("lsh+ks", "argmax"),
    ("sw+lsh+ks", "sign"),
    ("ks+sw", "sign"),  # slots after ks's contested one: t (sw's first) repeats it when t enters
    ("ks+lsh", "argmax"),
]


def _inputs(b, l, n, e, hash_bits, dtype=jnp.float32, seed=0):
    """make_inputs at these sizes."""
    return make_inputs(l, seed, dtype, hash_bits, b=b, n=n, e=e)


@functools.partial(jax.jit, static_argnames=("step", "spec"))
def _decode(cache, inputs, *, step, spec):
    """Every position through `step` in a scan: (outputs (b, l, e), the last cache)."""

    def body(cache, x):
        q, k, v, score = x
        o, cache = step(q, k, v, cache, spec=spec, hash_proj=inputs["hash_proj"], key_score=score)
        return cache, o

    seq = [jnp.moveaxis(inputs[name], 1, 0) for name in ("q", "k", "v", "key_scores")]
    cache, o_lbe = jax.lax.scan(body, cache, seq)
    return jnp.moveaxis(o_lbe, 0, 1), cache


def _assert_caches_equal(actual, desired, tol):
    """Positions and buckets exactly; keys, values, sums and scores within `tol`."""
    for name in desired._fields:
        a, d = np.asarray(getattr(actual, name)), np.asarray(getattr(desired, name))
        assert (a.shape, a.dtype) == (d.shape, d.dtype), name
        if a.dtype.kind in "iu":
            np.testing.assert_array_equal(a, d, err_msg=name)
        else:
            assert_close(a, d, tol, name)


def _check(pattern, binning, b, l, n, e, hash_bits, num_keys, dtype, capacity=None):
    """The kernel's outputs against the dense definition, its cache against step_arrays'."""
    spec = SparseSpec(pattern, num_keys, hash_bits=hash_bits, binning=binning, max_len=l)
    inputs = _inputs(b, l, n, e, hash_bits, dtype)
    cache = init_cache(b, capacity or l, n, e, spec=spec, dtype=dtype)
    o, kernel_cache = _decode(cache, inputs, step=step_pallas, spec=spec)
    want = sparse_attention_reference(
        inputs["q"], inputs["k"], inputs["v"], spec=spec, hash_proj=inputs["hash_proj"],
        key_scores=inputs["key_scores"],
    )  # fmt: skip
    assert_close(o, want, TOL[dtype], "o")
    _, plain_cache = _decode(cache, inputs, step=step_arrays, spec=spec)
    _assert_caches_equal(kernel_cache, plain_cache, TOL[dtype])


@pytest.mark.parametrize("pattern, binning", CASES, ids=[f"{p}-{b}" for p, b in CASES])
def test_kernel_step_equals_the_definition(pattern, binning):
    """37 tokens, 12 keys: the LSH rows overflow (8 buckets) and the top-kc list turns over."""
    _check(pattern, binning, B, 37, N, E, H, 12, jnp.float32, capacity=40)


def test_kernel_step_in_bf16():
    """bf16 inputs and buffers (as generate keeps them), one value chunk of 32."""
    _check("lsh+ks", "sign", B, 29, N, 32, H, 12, jnp.bfloat16)


def test_kernel_step_past_capacity_gives_nan_and_keeps_the_buffers():
    """Under jit a full cache cannot raise: the output is NaN, the key and value rows unchanged."""
    spec = SparseSpec("lsh+ks", 4, hash_bits=H)
    inputs = _inputs(B, 3, N, E, H)
    cache = init_cache(B, 2, N, E, spec=spec)
    args = dict(spec=spec, hash_proj=inputs["hash_proj"])
    for t in range(2):
        _, cache = step_pallas(
            *(inputs[x][:, t] for x in "qkv"), cache, key_score=inputs["key_scores"][:, t], **args
        )
    o, full = step_pallas(
        *(inputs[x][:, 2] for x in "qkv"), cache, key_score=inputs["key_scores"][:, 2], **args
    )
    assert np.all(np.isnan(o))
    np.testing.assert_array_equal(full.keys, cache.keys)
    np.testing.assert_array_equal(full.values, cache.values)


def test_kernel_applies_the_scorers_last_layer():
    """A LinearScore (features (b, 5): padded to 8 inside) gives the step it scores: the kernel's
    cache and outputs equal step_arrays' given features @ weight + bias. Small integers, so every
    sum is exact in any order and ks still sees ties."""
    spec = SparseSpec("lsh+ks", 8, hash_bits=H)
    l, m = 21, 5
    inputs = _inputs(B, l, N, E, H)
    rng = np.random.default_rng(1)
    features = jnp.asarray(rng.integers(-2, 3, (B, l, m)), jnp.float32)
    weight, bias = jnp.asarray([1.0, -1.0, 2.0, 0.0, 1.0]), jnp.asarray(0.5)
    inputs["key_scores"] = features @ weight + bias

    @jax.jit
    def by_layer(cache):
        def body(cache, x):
            q, k, v, f = x
            score = LinearScore(f, weight, bias)
            o, cache = step_pallas(q, k, v, cache, spec=spec, hash_proj=inputs["hash_proj"],
                                   key_score=score)  # fmt: skip
            return cache, o

        seq = [jnp.moveaxis(x, 1, 0) for x in (inputs["q"], inputs["k"], inputs["v"], features)]
        cache, o_lbe = jax.lax.scan(body, cache, seq)
        return jnp.moveaxis(o_lbe, 0, 1), cache

    cache = init_cache(B, l, N, E, spec=spec)
    o, kernel_cache = by_layer(cache)
    want, plain_cache = _decode(cache, inputs, step=step_arrays, spec=spec)
    assert_close(o, want, TOL[jnp.float32], "o")
    _assert_caches_equal(kernel_cache, plain_cache, TOL[jnp.float32])


def test_impl_picks_the_kernel_and_refuses_what_it_cannot_run():
    spec = SparseSpec("lsh+ks", 8, hash_bits=H)
    # auto: the kernel on a GPU, the plain-JAX step elsewhere
    assert picks_step_pallas(spec, N, E, "auto") == backend.kernels_by_default()
    assert not picks_step_pallas(spec, N, E, "indexed")
    assert picks_step_pallas(spec, N, E, "pallas")
    assert unsupported(spec, 12, E) == "the key dim n = 12 is not a power of two"
    with pytest.raises(ValueError, match="'full' component reads every cache row"):
        picks_step_pallas(SparseSpec("full", 8), N, E, "pallas")
    with pytest.raises(ValueError, match="value dim e = 40 is not a multiple of 16"):
        picks_step_pallas(spec, N, 40, "pallas")
    with pytest.raises(ValueError, match="impl must be one of"):
        picks_step_pallas(spec, N, E, "triton")
    # impl="pallas" through the public step (interpreted here) is the kernel.
    inputs = _inputs(B, 1, N, E, H)
    step = [inputs[x][:, 0] for x in "qkv"]
    extra = dict(spec=spec, hash_proj=inputs["hash_proj"], key_score=inputs["key_scores"][:, 0])
    cache = init_cache(B, 4, N, E, spec=spec)
    o, _ = sparse_attention_step(*step, cache, impl="pallas", **extra)
    want, _ = step_arrays(*step, cache, **extra)
    assert_close(o, want, TOL[jnp.float32])


@pytest.mark.parametrize("pattern, binning", [("lsh+ks", "sign"), ("sw+dilated+ks", "argmax")])
def test_kernel_lowers_for_cuda_at_the_hax_130m_shapes(pattern, binning):
    """Cross-lowered (no GPU needed): n 128, e 1536, 64 keys, 8 hash bits, bf16 buffers, the key
    score as the HaxBranch step gives it (the scorer's last layer, 256 features)."""
    spec = SparseSpec(pattern, 64, hash_bits=8, binning=binning, max_len=2048)
    b, capacity, n, e = 1, 2176, 128, 1536
    cache = init_cache(b, capacity, n, e, spec=spec, dtype=jnp.bfloat16)
    cache = cache._replace(t=jnp.asarray(cache.t))
    q = k = jnp.zeros((b, n), jnp.bfloat16)
    step = functools.partial(step_pallas, spec=spec, interpret=False)
    text = lower_for(
        "cuda", step, q, k, jnp.zeros((b, e), jnp.bfloat16), cache,
        hash_proj=jnp.zeros((n, 8)),
        key_score=LinearScore(jnp.zeros((b, 2 * n)), jnp.zeros((2 * n,)), jnp.zeros(())),
    )  # fmt: skip
    assert "triton_kernel_call" in text or "__gpu$xla.gpu.triton" in text


@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 64])
def test_compiled_gpu_kernel_step_equals_the_plain_step(b, monkeypatch):
    """Compiled at the HAX 130M branch's shapes (bf16, n 128, e 1536, 64 keys, 256 buckets) over
    300 tokens: the barriers order each program's reads and writes of the same rows."""
    monkeypatch.setitem(COMPILED, "on", True)
    spec = SparseSpec("lsh+ks", 64, hash_bits=8)
    inputs = _inputs(b, 300, 128, 1536, 8, jnp.bfloat16, seed=3)
    cache = init_cache(b, 320, 128, 1536, spec=spec, dtype=jnp.bfloat16)
    o, kernel_cache = _decode(cache, inputs, step=step_pallas, spec=spec)
    want, plain_cache = _decode(cache, inputs, step=step_arrays, spec=spec)
    assert_close(o, want, TOL[jnp.bfloat16], "o")
    _assert_caches_equal(kernel_cache, plain_cache, TOL[jnp.bfloat16])
