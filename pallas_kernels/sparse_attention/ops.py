"""Public HAX sparse attention: input checks, the parallel op, the cache, the decode step and the
parallel prefill of a cache. The settings travel as one `SparseSpec` (spec.py), validated there."""

import functools

import jax
import jax.numpy as jnp

from .. import backend
from ..checks import check_float, check_shape
from . import decode_pallas, pallas
from .decode import (
    LinearScore,
    SparseAttentionCache,
    init_cache_arrays,
    prefill_arrays,
    step_arrays,
)
from .indexed import sparse_attention_indexed
from .reference import sparse_attention_reference
from .spec import SparseSpec, check_positive_int
from .tiling import BlockSizes

IMPLS = ("auto", "indexed", "pallas")
# sparse_attention's settings when a spec is given instead.
_LOOSE_DEFAULTS = dict(
    pattern=None, num_keys=None, max_len=None, binning="sign", official_code=False
)


def _check_spec(spec):
    """ValueError unless `spec` is a SparseSpec (which validated itself when built)."""
    if not isinstance(spec, SparseSpec):
        raise ValueError(f"spec must be a SparseSpec, got {type(spec).__name__}")


def _check_causal(spec):
    """The decode cache follows the causal op only: official_code reads the whole sequence."""
    if spec.official_code:
        raise ValueError("official_code=True has no step mode (it is not causal)")


def _validate_hash_proj(spec, hash_proj, n):
    """hash_proj (n, spec.hash_bits) is required by lsh."""
    if not spec.has("lsh"):
        return
    if hash_proj is None:
        raise ValueError(f"hash_proj (n, h) is required by 'lsh' in pattern {spec.pattern!r}")
    if hash_proj.shape != (n, spec.hash_bits):
        raise ValueError(
            f"hash_proj must have shape (n, h) = {(n, spec.hash_bits)}, got {hash_proj.shape}"
        )
    check_float("hash_proj", hash_proj)


def _validate(q, k, v, spec, hash_proj, key_scores):
    """Check the shapes and dtypes of the parallel op's inputs against the spec."""
    if q.ndim != 3:
        raise ValueError(f"q must have shape (b, l, n), got {q.shape}")
    b, l, n = q.shape
    check_shape("k", k, (b, l, n), "(b, l, n)")
    if v.ndim != 3 or v.shape[:2] != (b, l):
        raise ValueError(f"v must have shape (b, l, e) with (b, l) = {(b, l)}, got {v.shape}")
    for name, arr in (("q", q), ("k", k), ("v", v)):
        check_float(name, arr)
    _validate_hash_proj(spec, hash_proj, n)
    if spec.has("ks"):
        if key_scores is None:
            raise ValueError(f"key_scores (b, l) is required by 'ks' in pattern {spec.pattern!r}")
        check_shape("key_scores", key_scores, (b, l), "(b, l)")
        check_float("key_scores", key_scores)


def _pallas_order(spec):
    """The components in the order `pallas.SUPPORTED_PATTERNS` lists them."""
    return "+".join(sorted(spec.components, reverse=True))


def _check_pallas(spec, variant, blocks):
    """What impl="pallas" supports beyond the op's contract."""
    if spec.official_code:
        raise ValueError("impl='pallas' has no official_code mode (use impl='indexed')")
    if _pallas_order(spec) not in pallas.SUPPORTED_PATTERNS:
        raise ValueError(
            f"impl='pallas' supports the patterns {pallas.SUPPORTED_PATTERNS} (in any order), "
            f"got {spec.pattern!r}"
        )
    backend.check_variant(variant)
    for name in ("block_q", "block_k", "block_e"):
        size = getattr(blocks, name)
        if isinstance(size, bool) or not isinstance(size, int) or size < 16 or size & (size - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {size!r}")
    for name in ("num_warps", "num_stages"):
        check_positive_int(name, getattr(blocks, name))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _sparse_attention_pallas(q, k, v, layout, kc, cfg):
    """o by the Pallas kernels; differentiable in q, k, v through the hand-written backward."""
    return pallas.forward(q, k, v, layout, kc=kc, cfg=cfg)[0].astype(v.dtype)


def _sparse_attention_pallas_fwd(q, k, v, layout, kc, cfg):
    """Forward, saving the inputs, the selection, o and the log-sum-exp for the backward."""
    o, lse = pallas.forward(q, k, v, layout, kc=kc, cfg=cfg)
    return o.astype(v.dtype), (q, k, v, layout, o, lse)


def _sparse_attention_pallas_bwd(kc, cfg, residuals, do):
    """The backward kernels (FlashAttention-2 style, from the saved lse)."""
    q, k, v, layout, o, lse = residuals
    dq, dk, dv = pallas.backward(q, k, v, layout, o, lse, do, kc=kc, cfg=cfg)
    return dq, dk, dv, None  # the selection (layout) is discrete: no gradient


_sparse_attention_pallas.defvjp(_sparse_attention_pallas_fwd, _sparse_attention_pallas_bwd)


def picks_pallas(spec, impl, variant=None) -> bool:
    """Whether `impl` runs the Pallas kernels for `spec` here: "pallas", or "auto" where
    `backend.auto_picks_pallas()` and the kernels take the pattern."""
    if impl != "auto":
        return impl == "pallas"
    return (
        backend.auto_picks_pallas()
        and variant in (None, "gpu")
        and not spec.official_code
        and _pallas_order(spec) in pallas.SUPPORTED_PATTERNS
    )


def sparse_attention_of_layout(q, k, v, layout, spec, *, blocks, variant=None):
    """impl="pallas" over a selection the caller built with `blocks` (`pallas.layout_of`, e.g.
    buckets centred over a whole sequence of which q, k, v are a shard: carry_pallas.py): o (b,
    lq, e) in v.dtype. q (b, lq, n) are the queries at the last lq of the lk positions of k (b,
    lk, n) and v (b, lk, e) (lq < lk: layout_of(n_queries=lq))."""
    variant = variant or backend.default_variant()
    _check_pallas(spec, variant, blocks)
    cfg = (pallas.effective_blocks(blocks, v.shape[-1]), variant, None)
    return _sparse_attention_pallas(q, k, v, layout, spec.keys_per_component, cfg)


@functools.partial(
    jax.jit,
    static_argnames=(
        "spec",
        "pattern",
        "num_keys",
        "max_len",
        "binning",
        "official_code",
        "impl",
        "variant",
        "interpret",
        "block_q",
        "block_k",
        "block_e",
        "num_warps",
        "num_stages",
    ),
)
def sparse_attention(
    q,
    k,
    v,
    *,
    spec=None,
    pattern=None,
    num_keys=None,
    hash_proj=None,
    key_scores=None,
    max_len=None,
    binning="sign",
    official_code=False,
    impl="auto",
    variant=None,
    interpret=None,
    block_q=64,
    block_k=64,
    block_e=128,
    num_warps=4,
    num_stages=2,
):
    """HAX context-dependent sparse attention (one head, causal): o (b, l, e) in v.dtype.

    The attention is a `SparseSpec` (the one the decode cache, step and prefill take), or the
    settings pattern, num_keys, max_len, binning and official_code that build it (hash_bits = h
    of hash_proj); not both. q, k (b, l, n) (k already scaled: logits are exactly q_i . k_j); v (b,
    l, e); hash_proj (n, h) for lsh; key_scores (b, l) for ks (no gradient through the selection);
    max_len for dilated. pattern: '+'-joined components of ("sw", "sink", "dilated", "lsh",
    "ks"), or "full" alone; each gets kc = num_keys // #components keys, query i attends to the
    union of their causal key sets (see reference.py), softmax over those keys only, fp32
    compute. A query with no selected key outputs 0 (zero gradient). binning: "sign" (2^h
    buckets) or "argmax" (h buckets); key_scores should be finite (ties go to the earlier
    position).

    Every pattern but "full" costs O(l * num_keys * (n + e)) time and O(l * num_keys) memory,
    forward and backward (no (l, l) array). official_code=True reproduces the official PyTorch
    code instead (non-causal LSH centring and normalisation over the whole sequence; a query
    with no selected key gets a uniform softmax over ALL l positions, future included) with
    dense (l, l) masks: quadratic by design, and not causal.

    impl: "auto" ("pallas" where `backend.auto_picks_pallas()` and it takes the pattern, else
    "indexed"), "indexed" (gathers each query's keys, pure JAX) or "pallas" (flash-style kernels
    over key tiles shared by blocks of queries; patterns lsh, ks, lsh+ks only; same result).
    Pallas only: variant "gpu" (Triton) or "tpu" (Mosaic), None = the backend's; interpret
    None = compiled on the variant's hardware, interpreted elsewhere; block_q (queries per
    block), block_k (sorted keys per lsh tile), block_e (value columns per program), powers of
    two >= 16, and Triton's num_warps / num_stages are tuning knobs.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    settings = dict(
        pattern=pattern,
        num_keys=num_keys,
        max_len=max_len,
        binning=binning,
        official_code=official_code,
    )
    if spec is None:
        hash_bits = None if hash_proj is None else hash_proj.shape[-1]
        spec = SparseSpec(**settings, hash_bits=hash_bits)
    else:
        _check_spec(spec)
        loose = {name: value for name, value in settings.items() if value != _LOOSE_DEFAULTS[name]}
        if loose:
            raise ValueError(f"give the attention as spec or as its settings, not both: {loose}")
    if impl == "auto":
        impl = "pallas" if picks_pallas(spec, impl, variant) else "indexed"
    if impl == "pallas":
        variant = variant or backend.default_variant()
        blocks = BlockSizes(block_q, block_k, block_e, num_warps, num_stages)
        _check_pallas(spec, variant, blocks)
    _validate(q, k, v, spec, hash_proj, key_scores)
    inputs = dict(spec=spec, hash_proj=hash_proj, key_scores=key_scores)
    if impl == "pallas":
        layout = pallas.build_layout(q, k, blocks=blocks, **inputs)
        cfg = (pallas.effective_blocks(blocks, v.shape[-1]), variant, interpret)
        return _sparse_attention_pallas(q, k, v, layout, spec.keys_per_component, cfg)
    if spec.official_code:
        return sparse_attention_reference(q, k, v, **inputs)
    return sparse_attention_indexed(q, k, v, **inputs)


def init_cache(batch, capacity, n, e, *, spec, dtype=jnp.float32):
    """An empty `SparseAttentionCache` for up to `capacity` decode steps of the attention `spec`
    (a `SparseSpec`; lsh needs its hash_bits). dtype: of the key and value buffers (the sums and
    scores are fp32)."""
    _check_spec(spec)
    for name, value in (("batch", batch), ("capacity", capacity), ("n", n), ("e", e)):
        check_positive_int(name, value)
    return init_cache_arrays(batch, capacity, n, e, spec=spec, dtype=dtype)


_step_jit = jax.jit(step_arrays, static_argnames=("spec",))
_step_pallas_jit = jax.jit(decode_pallas.step_pallas, static_argnames=("spec",))


def picks_step_pallas(spec, n, e, impl) -> bool:
    """Whether the decode step runs as Pallas kernels (decode_pallas): impl="pallas" (a
    ValueError naming why if it cannot), or "auto" where `backend.auto_picks_pallas()` and the
    kernel takes the spec and shapes."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    why = decode_pallas.unsupported(spec, n, e)
    if impl == "pallas" and why is not None:
        raise ValueError(f"impl='pallas' has no decode kernel for {spec.pattern!r} here: {why}")
    if impl == "auto":
        return why is None and backend.auto_picks_pallas()
    return impl == "pallas"


def sparse_attention_step(q, k, v, cache, *, spec, hash_proj=None, key_score=None, impl="auto"):
    """One decode step of `sparse_attention`: (o (b, e) in v.dtype, the updated cache).

    q, k (b, n); v (b, e); hash_proj (n, spec.hash_bits) for lsh; key_score (b,) for ks (or a
    LinearScore: the scorer's last layer, applied inside the Pallas step's kernel); cache
    from `init_cache` with the same spec. Writes k, v at position cache.t and attends as query t
    of the parallel op would, touching O(num_keys) cache rows ("full" reads all of them).
    ValueError naming capacity when cache.t is concrete and already equals capacity; under an
    outer jit (traced t) that cannot raise, and the output is NaN instead. official_code has
    no step mode (its LSH centring and empty-row softmax read the whole sequence). impl: "auto"
    (Pallas kernels on a GPU where they take the spec, see `picks_step_pallas`), "pallas", or
    "indexed" (decode.step_arrays, the plain-JAX definition).
    """
    _check_spec(spec)
    _check_causal(spec)
    if not isinstance(cache, SparseAttentionCache):
        raise ValueError(f"cache must be a SparseAttentionCache, got {type(cache).__name__}")
    b, capacity, n = cache.keys.shape
    e = cache.values.shape[-1]
    check_shape("q", q, (b, n), "(b, n)")
    check_shape("k", k, (b, n), "(b, n)")
    check_shape("v", v, (b, e), "(b, e)")
    for name, arr in (("q", q), ("k", k), ("v", v)):
        check_float(name, arr)
    _validate_hash_proj(spec, hash_proj, n)
    _check_cache(cache, b, n, e, spec)
    if spec.has("ks"):
        _check_key_score(key_score, b, spec)
    if not isinstance(cache.t, jax.core.Tracer) and int(cache.t) >= capacity:
        raise ValueError(f"cache is full: t = {int(cache.t)} reached capacity = {capacity}")
    step = _step_pallas_jit if picks_step_pallas(spec, n, e, impl) else _step_jit
    return step(q, k, v, cache, spec=spec, hash_proj=hash_proj, key_score=key_score)


def _check_key_score(key_score, b, spec):
    """key_score is a float (b,) array, or a LinearScore of features (b, m), weight (m,) and a
    scalar bias, all float."""
    if key_score is None:
        raise ValueError(f"key_score (b,) is required by 'ks' in pattern {spec.pattern!r}")
    if not isinstance(key_score, LinearScore):
        check_shape("key_score", key_score, (b,), "(b,)")
        check_float("key_score", key_score)
        return
    features, weight, bias = key_score
    if features.ndim != 2:
        raise ValueError(f"key_score.features must be (b, m), got shape {features.shape}")
    m = features.shape[1]
    check_shape("key_score.features", features, (b, m), "(b, m)")
    check_shape("key_score.weight", weight, (m,), "(m,)")
    check_shape("key_score.bias", bias, (), "()")
    for name, arr in zip(LinearScore._fields, key_score):
        check_float(f"key_score.{name}", arr)


def _check_cache(cache, b, n, e, spec):
    """The cache is a SparseAttentionCache for batch b, key dim n, value dim e and this spec."""
    if not isinstance(cache, SparseAttentionCache):
        raise ValueError(f"cache must be a SparseAttentionCache, got {type(cache).__name__}")
    capacity = cache.keys.shape[1]
    kc = spec.keys_per_component
    check_shape("cache.keys", cache.keys, (b, capacity, n), "(b, capacity, n)")
    check_shape("cache.values", cache.values, (b, capacity, e), "(b, capacity, e)")
    if spec.has("lsh"):
        shape = (b, spec.num_buckets, kc)
        check_shape("cache.lsh_table", cache.lsh_table, shape, "(b, n_buckets, kc)")
    if spec.has("ks"):
        check_shape("cache.ks_scores", cache.ks_scores, (b, kc), "(b, kc)")


_prefill_jit = jax.jit(prefill_arrays, static_argnames=("spec",))


def prefill_cache(q, k, v, cache, *, spec, hash_proj=None, key_scores=None):
    """The cache after positions 0..l-1 from an EMPTY cache, built in parallel: the same cache as
    l calls of `sparse_attention_step` (to rounding in the fp32 sums; the LSH buckets are the
    parallel op's, which the step's equal up to that rounding).

    q, k (b, l, n); v (b, l, e); hash_proj (n, spec.hash_bits) for lsh; key_scores (b, l) for
    ks: key j's score as the step would get it (the parallel op's key_scores); cache from
    `init_cache` with the same spec, capacity >= l. ValueError naming both when l > capacity,
    and naming t when cache.t is concrete and not 0; a traced t cannot be checked and is taken
    to be 0. O(l log l) time, no (l, l) array. Pair it with `sparse_attention` for the prompt's
    outputs.
    """
    _check_spec(spec)
    _check_causal(spec)
    _validate(q, k, v, spec, hash_proj, key_scores)
    b, l, n = q.shape
    _check_cache(cache, b, n, v.shape[-1], spec)
    capacity = cache.keys.shape[1]
    if l > capacity:
        raise ValueError(f"the prompt (l = {l}) does not fit the cache (capacity = {capacity})")
    if not isinstance(cache.t, jax.core.Tracer) and int(cache.t) != 0:
        raise ValueError(
            f"prefill_cache starts from an empty cache (t = 0), got t = {int(cache.t)}"
        )
    return _prefill_jit(q, k, v, cache, spec=spec, hash_proj=hash_proj, key_scores=key_scores)
