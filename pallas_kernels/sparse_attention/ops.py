"""Public HAX sparse attention: input checks, the parallel op, the cache, the decode step and the
parallel prefill of a cache."""

import functools

import jax
import jax.numpy as jnp

from .. import backend
from ..checks import check_float, check_shape
from . import flash
from .indexed import sparse_attention_indexed
from .kernel import BlockSizes
from .prefill import prefill_arrays
from .reference import BINNINGS, COMPONENTS, component_budget, sparse_attention_reference
from .step import SparseAttentionCache, init_cache_arrays, step_arrays

# Sign buckets are int32 bit sets: 2^h must fit.
MAX_SIGN_BITS = 30
IMPLS = ("auto", "indexed", "pallas")


def parse_pattern(pattern):
    """The components of `pattern` as a tuple; ValueError naming the pattern if it is bad."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"pattern must be a non-empty '+'-joined string, got {pattern!r}")
    comps = tuple(pattern.split("+"))
    for comp in comps:
        if comp not in COMPONENTS:
            raise ValueError(
                f"unknown component {comp!r} in pattern {pattern!r}; known: {COMPONENTS}"
            )
    for comp in set(comps):
        if comps.count(comp) > 1:
            raise ValueError(f"component {comp!r} repeated in pattern {pattern!r}")
    if "full" in comps and len(comps) > 1:
        raise ValueError(f"'full' cannot be combined with other components: {pattern!r}")
    return comps


def _check_positive_int(name, value):
    """ValueError naming `value` unless it is a positive int (bool excluded)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _validate_static(pattern, num_keys, max_len, binning):
    """Check the static arguments; return the components."""
    comps = parse_pattern(pattern)
    _check_positive_int("num_keys", num_keys)
    if num_keys < len(comps):
        raise ValueError(
            f"num_keys = {num_keys} is smaller than the {len(comps)} components of {pattern!r}"
        )
    if binning not in BINNINGS:
        raise ValueError(f"binning must be one of {BINNINGS}, got {binning!r}")
    if "dilated" in comps:
        if max_len is None:
            raise ValueError(f"max_len is required by 'dilated' in pattern {pattern!r}")
        _check_positive_int("max_len", max_len)
    return comps


def _validate_hash_proj(comps, pattern, hash_proj, n, binning):
    """hash_proj (n, h) is required by lsh; sign binning needs h <= MAX_SIGN_BITS."""
    if "lsh" not in comps:
        return
    if hash_proj is None:
        raise ValueError(f"hash_proj (n, h) is required by 'lsh' in pattern {pattern!r}")
    if hash_proj.ndim != 2 or hash_proj.shape[0] != n or hash_proj.shape[1] == 0:
        raise ValueError(f"hash_proj must have shape (n, h) with n = {n}, got {hash_proj.shape}")
    check_float("hash_proj", hash_proj)
    if binning == "sign" and hash_proj.shape[1] > MAX_SIGN_BITS:
        raise ValueError(
            f"sign binning takes at most {MAX_SIGN_BITS} hash bits, got h = {hash_proj.shape[1]}"
        )


def _validate(q, k, v, pattern, num_keys, hash_proj, key_scores, max_len, binning):
    """Check shapes, dtypes and static arguments; return the components."""
    comps = _validate_static(pattern, num_keys, max_len, binning)
    if q.ndim != 3:
        raise ValueError(f"q must have shape (b, l, n), got {q.shape}")
    b, l, n = q.shape
    check_shape("k", k, (b, l, n), "(b, l, n)")
    if v.ndim != 3 or v.shape[:2] != (b, l):
        raise ValueError(f"v must have shape (b, l, e) with (b, l) = {(b, l)}, got {v.shape}")
    for name, arr in (("q", q), ("k", k), ("v", v)):
        check_float(name, arr)
    _validate_hash_proj(comps, pattern, hash_proj, n, binning)
    if "ks" in comps:
        if key_scores is None:
            raise ValueError(f"key_scores (b, l) is required by 'ks' in pattern {pattern!r}")
        check_shape("key_scores", key_scores, (b, l), "(b, l)")
        check_float("key_scores", key_scores)
    return comps


def _check_pallas(pattern, official_code, variant, blocks):
    """What impl="pallas" supports beyond the op's contract."""
    if official_code:
        raise ValueError("impl='pallas' has no official_code mode (use impl='indexed')")
    parse_pattern(pattern)
    if "+".join(sorted(pattern.split("+"), reverse=True)) not in flash.SUPPORTED_PATTERNS:
        raise ValueError(
            f"impl='pallas' supports the patterns {flash.SUPPORTED_PATTERNS} (in any order), "
            f"got {pattern!r}"
        )
    backend.check_variant(variant)
    for name in ("block_q", "block_k", "block_e"):
        size = getattr(blocks, name)
        if isinstance(size, bool) or not isinstance(size, int) or size < 16 or size & (size - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {size!r}")
    for name in ("num_warps", "num_stages"):
        _check_positive_int(name, getattr(blocks, name))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _sparse_attention_pallas(q, k, v, layout, kc, cfg):
    """o by the Pallas kernels; differentiable in q, k, v through the hand-written backward."""
    return flash.forward(q, k, v, layout, kc=kc, cfg=cfg)[0].astype(v.dtype)


def _sparse_attention_pallas_fwd(q, k, v, layout, kc, cfg):
    """Forward, saving the inputs, the selection, o and the log-sum-exp for the backward."""
    o, lse = flash.forward(q, k, v, layout, kc=kc, cfg=cfg)
    return o.astype(v.dtype), (q, k, v, layout, o, lse)


def _sparse_attention_pallas_bwd(kc, cfg, residuals, do):
    """The backward kernels (FlashAttention-2 style, from the saved lse)."""
    q, k, v, layout, o, lse = residuals
    dq, dk, dv = flash.backward(q, k, v, layout, o, lse, do, kc=kc, cfg=cfg)
    return dq, dk, dv, None  # the selection (layout) is discrete: no gradient


_sparse_attention_pallas.defvjp(_sparse_attention_pallas_fwd, _sparse_attention_pallas_bwd)


@functools.partial(
    jax.jit,
    static_argnames=(
        "pattern", "num_keys", "max_len", "binning", "official_code", "impl", "variant",
        "interpret", "block_q", "block_k", "block_e", "num_warps", "num_stages",
    ),
)  # fmt: skip
def sparse_attention(
    q,
    k,
    v,
    *,
    pattern,
    num_keys,
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

    q, k (b, l, n) (k already scaled: logits are exactly q_i . k_j); v (b, l, e); hash_proj
    (n, h) for lsh; key_scores (b, l) for ks (no gradient through the selection); max_len for
    dilated. pattern: '+'-joined components of ("sw", "sink", "dilated", "lsh", "ks"), or
    "full" alone; each gets kc = num_keys // #components keys, query i attends to the union of
    their causal key sets (see reference.py), softmax over those keys only, fp32 compute. A
    query with no selected key outputs 0 (zero gradient). binning: "sign" (2^h buckets) or
    "argmax" (h buckets); key_scores should be finite (ties go to the earlier position).

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
    if impl == "auto":
        impl = "indexed"
        if backend.auto_picks_pallas() and variant in (None, "gpu") and not official_code:
            order = "+".join(sorted(str(pattern).split("+"), reverse=True))
            impl = "pallas" if order in flash.SUPPORTED_PATTERNS else "indexed"
    if impl == "pallas":
        variant = variant or backend.default_variant()
        blocks = BlockSizes(block_q, block_k, block_e, num_warps, num_stages)
        _check_pallas(pattern, official_code, variant, blocks)
    comps = _validate(q, k, v, pattern, num_keys, hash_proj, key_scores, max_len, binning)
    kwargs = dict(
        pattern=pattern,
        num_keys=num_keys,
        hash_proj=hash_proj,
        key_scores=key_scores,
        max_len=max_len,
        binning=binning,
    )
    if impl == "pallas":
        kc = component_budget(pattern, num_keys)
        layout = flash.build_layout(
            q, k, comps=comps, kc=kc, hash_proj=hash_proj, key_scores=key_scores,
            binning=binning, blocks=blocks,
        )  # fmt: skip
        cfg = (flash.effective_blocks(blocks, v.shape[-1]), variant, interpret)
        return _sparse_attention_pallas(q, k, v, layout, kc, cfg)
    if official_code:
        return sparse_attention_reference(q, k, v, official_code=True, **kwargs)
    return sparse_attention_indexed(q, k, v, **kwargs)


def init_cache(
    batch,
    capacity,
    n,
    e,
    *,
    pattern,
    num_keys,
    hash_bits=None,
    binning="sign",
    dtype=jnp.float32,
):
    """An empty `SparseAttentionCache` for up to `capacity` decode steps.

    hash_bits: h of hash_proj (n, h), required when pattern has lsh; dtype: of the key and
    value buffers (the sums and scores are fp32).
    """
    comps = _validate_static(pattern, num_keys, 1, binning)  # max_len only matters per step
    for name, value in (("batch", batch), ("capacity", capacity), ("n", n), ("e", e)):
        _check_positive_int(name, value)
    if "lsh" in comps:
        if hash_bits is None:
            raise ValueError(f"hash_bits is required by 'lsh' in pattern {pattern!r}")
        _check_positive_int("hash_bits", hash_bits)
        if binning == "sign" and hash_bits > MAX_SIGN_BITS:
            raise ValueError(
                f"sign binning takes at most {MAX_SIGN_BITS} hash bits, got {hash_bits}"
            )
    return init_cache_arrays(
        batch,
        capacity,
        n,
        e,
        pattern=pattern,
        num_keys=num_keys,
        hash_bits=hash_bits,
        binning=binning,
        dtype=dtype,
    )


_step_jit = jax.jit(step_arrays, static_argnames=("pattern", "num_keys", "max_len", "binning"))


def sparse_attention_step(
    q,
    k,
    v,
    cache,
    *,
    pattern,
    num_keys,
    hash_proj=None,
    key_score=None,
    max_len=None,
    binning="sign",
    official_code=False,
):
    """One decode step of `sparse_attention`: (o (b, e) in v.dtype, the updated cache).

    q, k (b, n); v (b, e); key_score (b,) for ks; cache from `init_cache` with the same
    pattern, num_keys, binning and h. Writes k, v at position cache.t and attends as query t
    of the parallel op would, touching O(num_keys) cache rows ("full" reads all of them).
    ValueError naming capacity when cache.t is concrete and already equals capacity; under an
    outer jit (traced t) that cannot raise, and the output is NaN instead. official_code has
    no step mode (its LSH centring and empty-row softmax read the whole sequence).
    """
    if official_code:
        raise ValueError("official_code=True has no step mode (it is not causal)")
    comps = _validate_static(pattern, num_keys, max_len, binning)
    if not isinstance(cache, SparseAttentionCache):
        raise ValueError(f"cache must be a SparseAttentionCache, got {type(cache).__name__}")
    b, capacity, n = cache.keys.shape
    e = cache.values.shape[-1]
    check_shape("q", q, (b, n), "(b, n)")
    check_shape("k", k, (b, n), "(b, n)")
    check_shape("v", v, (b, e), "(b, e)")
    for name, arr in (("q", q), ("k", k), ("v", v)):
        check_float(name, arr)
    kc = component_budget(pattern, num_keys)
    _validate_hash_proj(comps, pattern, hash_proj, n, binning)
    _check_cache(cache, b, n, e, comps, kc, hash_proj, binning)
    if "ks" in comps:
        if key_score is None:
            raise ValueError(f"key_score (b,) is required by 'ks' in pattern {pattern!r}")
        check_shape("key_score", key_score, (b,), "(b,)")
        check_float("key_score", key_score)
    if not isinstance(cache.t, jax.core.Tracer) and int(cache.t) >= capacity:
        raise ValueError(f"cache is full: t = {int(cache.t)} reached capacity = {capacity}")
    return _step_jit(
        q,
        k,
        v,
        cache,
        pattern=pattern,
        num_keys=num_keys,
        hash_proj=hash_proj,
        key_score=key_score,
        max_len=max_len,
        binning=binning,
    )


def _check_cache(cache, b, n, e, comps, kc, hash_proj, binning):
    """The cache is a SparseAttentionCache for batch b, key dim n, value dim e and this pattern."""
    if not isinstance(cache, SparseAttentionCache):
        raise ValueError(f"cache must be a SparseAttentionCache, got {type(cache).__name__}")
    capacity = cache.keys.shape[1]
    check_shape("cache.keys", cache.keys, (b, capacity, n), "(b, capacity, n)")
    check_shape("cache.values", cache.values, (b, capacity, e), "(b, capacity, e)")
    if "lsh" in comps:
        buckets = 2 ** hash_proj.shape[1] if binning == "sign" else hash_proj.shape[1]
        check_shape("cache.lsh_table", cache.lsh_table, (b, buckets, kc), "(b, n_buckets, kc)")
    if "ks" in comps:
        check_shape("cache.ks_scores", cache.ks_scores, (b, kc), "(b, kc)")


_prefill_jit = jax.jit(
    prefill_arrays, static_argnames=("pattern", "num_keys", "max_len", "binning")
)


def prefill_cache(
    q,
    k,
    v,
    cache,
    *,
    pattern,
    num_keys,
    hash_proj=None,
    key_scores=None,
    max_len=None,
    binning="sign",
):
    """The cache after positions 0..l-1 from an EMPTY cache, built in parallel: the same cache as
    l calls of `sparse_attention_step` (to rounding in the fp32 sums; the LSH buckets are the
    parallel op's, which the step's equal up to that rounding).

    q, k (b, l, n); v (b, l, e); key_scores (b, l) for ks: key j's score as the step would get
    it (the parallel op's key_scores); cache from `init_cache`, capacity >= l. ValueError
    naming both when l > capacity, and naming t when cache.t is concrete and not 0; a traced
    t cannot be checked and is taken to be 0. O(l log l) time, no (l, l) array. Pair it with
    `sparse_attention(q, k, v, ...)` for the prompt's outputs.
    """
    comps = _validate(q, k, v, pattern, num_keys, hash_proj, key_scores, max_len, binning)
    b, l, n = q.shape
    kc = component_budget(pattern, num_keys)
    _check_cache(cache, b, n, v.shape[-1], comps, kc, hash_proj, binning)
    capacity = cache.keys.shape[1]
    if l > capacity:
        raise ValueError(f"the prompt (l = {l}) does not fit the cache (capacity = {capacity})")
    if not isinstance(cache.t, jax.core.Tracer) and int(cache.t) != 0:
        raise ValueError(
            f"prefill_cache starts from an empty cache (t = 0), got t = {int(cache.t)}"
        )
    return _prefill_jit(
        q,
        k,
        v,
        cache,
        pattern=pattern,
        num_keys=num_keys,
        hash_proj=hash_proj,
        key_scores=key_scores,
        max_len=max_len,
        binning=binning,
    )
