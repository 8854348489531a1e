"""Multi-head causal self-attention with RoPE ("attention") and its sliding-window form ("swa").

Full attention is the quadratic baseline; its decode cache is a preallocated KV buffer of a fixed
capacity. Sliding-window attention (query i sees keys j with i - window < j <= i) runs in blocks
of `window` queries, each against its own block and the previous one, so it costs O(l * window)
and never builds an (l, l) array; its decode cache is a ring buffer of the last window - 1 keys
and values.

With the sequence split over the mesh's "seq" axis (hax_jax.parallel), each shard attends for its
own queries (RoPE at global positions, applied before the split): a sliding window takes the
previous shard's last window - 1 keys and values as its history (a halo, as the conv's), and full
attention all-gathers K and V over "seq" (the quadratic baseline's own cost).
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from hax_jax.config import DEFAULT_CAPACITY, ModelConfig
from hax_jax.layers import init
from hax_jax.layers.rope import apply_rope
from hax_jax.parallel import SEQ, from_last_shard, from_previous_shard, per_device, seq_shards

HEADS = ("batch", "seq", "heads", None)  # q, k, v, o: (b, l, h, head_dim)
HISTORY = ("batch", None, "heads", None)  # a window's history: (b, window - 1, h, head_dim)


class KVCache(NamedTuple):
    """Decode state of one attention layer: rotated keys and values, and the tokens seen so far.

    Full attention: slot t holds position t (capacity slots). Sliding window: a ring buffer of
    window - 1 slots; slot s holds the latest position q < pos with q % (window - 1) == s.
    """

    k: jax.Array  # (b, slots, h, head_dim), compute dtype, RoPE applied
    v: jax.Array  # (b, slots, h, head_dim), compute dtype
    pos: jax.Array  # () int32: tokens consumed, i.e. the position of the next token


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float) -> jax.Array:
    """Masked softmax attention: q (..., lq, h, d), k/v (..., lk, h, d), mask -> (..., lq, h, d).

    `mask` broadcasts to (..., h, lq, lk) (True = may attend). Logits and softmax are fp32; masked
    logits get the most negative finite fp32 (not -inf) so a fully masked row gives no NaN, and
    masked keys get exactly zero weight and zero gradient.
    """
    logits = jnp.einsum("...qhd,...khd->...hqk", q, k, preferred_element_type=jnp.float32) * scale
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("...hqk,...khd->...qhd", probs, v, preferred_element_type=jnp.float32)
    return out.astype(q.dtype)


def _no_seq_idx(name: str, seq_idx) -> None:
    """Raises when packed documents are asked of a mixer that does not support them."""
    if seq_idx is not None:
        raise ValueError(f"the {name} mixer does not support seq_idx (packed documents)")


class Attention(nnx.Module):
    """q/k/v projections -> RoPE on q, k -> causal softmax attention per head -> out projection.

    `window=None` is full attention; an int is a sliding window (see the module docstring).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, window: int | None = None):
        a = cfg.attention
        d, h = cfg.d_model, a.n_heads
        if a.head_dim is None and d % h:
            raise ValueError(
                f"d_model={d} must be a multiple of attention.n_heads={h} "
                "(or set attention.head_dim)"
            )
        hd = a.head_dim or d // h
        if window is not None and window < 2:
            raise ValueError(f"attention.window must be >= 2 for swa, got {window}")
        self.n_heads, self.head_dim, self.window, self.theta = h, hd, window, a.rope_theta
        self.dtype = jnp.dtype(cfg.dtype)
        self.scale = 1.0 / math.sqrt(hd)
        self.kind = "attention" if window is None else "swa"

        linear = functools.partial(init.linear, rngs=rngs, dtype=self.dtype)
        # Heads split over "tensor" (the flattened h * head_dim axis, head-aligned when the tensor
        # size divides n_heads); one all-reduce after o_proj.
        self.q_proj = linear(d, h * hd, ("embed", "heads"), use_bias=a.qkv_bias)
        self.k_proj = linear(d, h * hd, ("embed", "heads"), use_bias=a.qkv_bias)
        self.v_proj = linear(d, h * hd, ("embed", "heads"), use_bias=a.qkv_bias)
        # Scaled by 1/sqrt(n_layer), as mamba's out_proj (rescale_prenorm_residual).
        self.o_proj = linear(h * hd, d, ("heads", "embed"), scale=1 / math.sqrt(cfg.n_layer))

    def init_cache(self, batch: int, capacity: int = DEFAULT_CAPACITY) -> KVCache:
        """The empty cache: `capacity` slots for full attention, window - 1 for a sliding window."""
        slots = capacity if self.window is None else self.window - 1
        zeros = jnp.zeros((batch, slots, self.n_heads, self.head_dim), self.dtype)
        return KVCache(k=zeros, v=zeros, pos=jnp.zeros((), jnp.int32))

    def _qkv(self, x: jax.Array, positions: jax.Array):
        """x (b, l, d), positions (l,) -> rotated q, rotated k, v, each (b, l, h, head_dim)."""
        b, l, _ = x.shape
        q, k, v = (
            p(x).reshape(b, l, self.n_heads, self.head_dim)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        return apply_rope(q, positions, self.theta), apply_rope(k, positions, self.theta), v

    def _out(self, o: jax.Array) -> jax.Array:
        """Heads (..., h, head_dim) -> (..., d)."""
        return self.o_proj(o.reshape(*o.shape[:-2], self.n_heads * self.head_dim))

    def __call__(
        self, x: jax.Array, *, cache: KVCache | None = None, seq_idx=None, mask=None, rng=None
    ):
        """Parallel mode: x (b, l, d) from `cache` (None = fresh) -> (y (b, l, d), cache after x).

        `mask` (padding) is ignored: causality already keeps trailing padding out of real tokens;
        `rng` too (nothing here is random).
        """
        _no_seq_idx(self.kind, seq_idx)
        x = x.astype(self.dtype)
        p = jnp.zeros((), jnp.int32) if cache is None else cache.pos
        q, k, v = self._qkv(x, p + jnp.arange(x.shape[1]))
        if self.window is None:
            o, cache = self._full(q, k, v, cache)
        else:
            o, cache = self._windowed(q, k, v, cache)
        return self._out(o), cache

    def _full(self, q, k, v, cache: KVCache | None):
        """Full causal attention of the new tokens over the cached ones and themselves."""
        l = q.shape[1]
        if cache is None:  # training / first prefill: keys are just these l tokens
            o = per_device(
                functools.partial(_full_shard, scale=self.scale),
                dict(q=q, k=k, v=v),
                dict(q=HEADS, k=HEADS, v=HEADS),
                [HEADS],
                seq_aware=True,
            )
            # Hold at least this prefix; later calls must stay within the capacity.
            pad = ((0, 0), (0, max(DEFAULT_CAPACITY, l) - l), (0, 0), (0, 0))
            return o, KVCache(jnp.pad(k, pad), jnp.pad(v, pad), jnp.asarray(l, jnp.int32))
        # Continuing: write the new keys at their positions, then attend over the whole buffer.
        # Past the capacity the write would be clamped; keep p + l <= capacity.
        p = cache.pos
        ck = jax.lax.dynamic_update_slice(cache.k, k.astype(cache.k.dtype), (0, p, 0, 0))
        cv = jax.lax.dynamic_update_slice(cache.v, v.astype(cache.v.dtype), (0, p, 0, 0))
        mask = jnp.arange(ck.shape[1])[None] <= p + jnp.arange(l)[:, None]
        return attend(q, ck, cv, mask, self.scale), KVCache(ck, cv, p + l)

    def _windowed(self, q, k, v, cache: KVCache | None):
        """Sliding-window attention from the cache's history (or none), per sequence shard."""
        w = self.window
        if cache is None:
            cache = self.init_cache(q.shape[0])
        p = cache.pos
        # The ring buffer in time order: element i holds position p - (w - 1) + i.
        hist_k, hist_v = (jnp.roll(c, -(p % (w - 1)), axis=1) for c in (cache.k, cache.v))
        o, last_k, last_v = per_device(
            functools.partial(_window_shard, window=w, scale=self.scale),
            dict(q=q, k=k, v=v, hist_k=hist_k, hist_v=hist_v, pos=p),
            dict(q=HEADS, k=HEADS, v=HEADS, hist_k=HISTORY, hist_v=HISTORY, pos=()),
            [HEADS, HISTORY, HISTORY],
            seq_aware=True,
        )
        # The new cache: the last w - 1 tokens, laid out as the ring buffer.
        end = p + q.shape[1]
        shift = end % (w - 1)
        return o, KVCache(jnp.roll(last_k, shift, axis=1), jnp.roll(last_v, shift, axis=1), end)

    def step(self, x: jax.Array, cache: KVCache):
        """Recurrent mode, one token: x (b, d) -> (y (b, d), cache)."""
        x = x.astype(self.dtype)
        p = cache.pos
        q, k, v = self._qkv(x[:, None], p[None])  # (b, 1, h, hd)
        if self.window is None:
            ck = jax.lax.dynamic_update_slice(cache.k, k.astype(cache.k.dtype), (0, p, 0, 0))
            cv = jax.lax.dynamic_update_slice(cache.v, v.astype(cache.v.dtype), (0, p, 0, 0))
            o = attend(q, ck, cv, jnp.arange(ck.shape[1]) <= p, self.scale)
            return self._out(o[:, 0]), KVCache(ck, cv, p + 1)
        # Ring slots written so far (s < p) all lie in the window; the token also sees itself.
        slots = self.window - 1
        keys = jnp.concatenate([cache.k, k.astype(cache.k.dtype)], axis=1)
        vals = jnp.concatenate([cache.v, v.astype(cache.v.dtype)], axis=1)
        seen = jnp.concatenate([jnp.arange(slots) < p, jnp.ones((1,), bool)])
        o = attend(q, keys, vals, seen, self.scale)
        s = p % slots
        ck = jax.lax.dynamic_update_slice(cache.k, k.astype(cache.k.dtype), (0, s, 0, 0))
        cv = jax.lax.dynamic_update_slice(cache.v, v.astype(cache.v.dtype), (0, s, 0, 0))
        return self._out(o[:, 0]), KVCache(ck, cv, p + 1)


class SlidingWindowAttention(Attention):
    """Attention where each query sees itself and the cfg.attention.window - 1 keys before it."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs, window=cfg.attention.window)


def _shard_start(l: int) -> jax.Array | int:
    """Global position of this shard's first token (its index times its length l), 0 unsplit."""
    return jax.lax.axis_index(SEQ) * l if seq_shards() > 1 else 0


def _full_shard(q, k, v, *, scale: float) -> jax.Array:
    """Causal attention of this shard's queries over all keys: K and V all-gathered over "seq"
    (the quadratic baseline's memory; keys after the shard are masked)."""
    l = q.shape[1]
    if seq_shards() > 1:
        k, v = (jax.lax.all_gather(t, SEQ, axis=1, tiled=True) for t in (k, v))
    i = _shard_start(l) + jnp.arange(l)[:, None]
    return attend(q, k, v, i >= jnp.arange(k.shape[1])[None], scale)


def _window_shard(q, k, v, hist_k, hist_v, pos, *, window: int, scale: float):
    """`windowed_attention` of this shard, its history the previous shard's last window - 1 keys
    and values (a halo; the first shard's: the cache's) -> (o, last window - 1 keys, values)."""
    l = q.shape[1]
    if seq_shards() > 1 and l < window - 1:
        raise ValueError(
            f"each sequence shard holds {l} positions, fewer than attention.window - 1 = "
            f"{window - 1}: its history would span several shards; use fewer seq shards, a "
            "longer sequence or a shorter window"
        )

    def last(t, hist):
        """The window - 1 keys (or values) before the next shard, in time order."""
        return jnp.concatenate([hist, t.astype(hist.dtype)], axis=1)[:, -(window - 1) :]

    hist_k = from_previous_shard(last(k, hist_k), hist_k)
    hist_v = from_previous_shard(last(v, hist_v), hist_v)
    o = windowed_attention(q, k, v, hist_k, hist_v, pos + _shard_start(l), window, scale)
    return o, from_last_shard(last(k, hist_k)), from_last_shard(last(v, hist_v))


def windowed_attention(q, k, v, hist_k, hist_v, start, window: int, scale: float) -> jax.Array:
    """Sliding-window attention in blocks of `window` queries against two blocks of keys.

    q/k/v (b, l, h, d) at positions start ... start + l - 1; hist_k/hist_v (b, window - 1, h, d)
    the keys and values of the window - 1 positions before (those below 0 are empty)."""
    b, l, h, hd = q.shape
    w = window
    nb = -(-l // w)
    pad = ((0, 0), (0, nb * w - l), (0, 0), (0, 0))
    # Padding goes at the end, after every real query, so causality already hides it.
    qp, kp, vp = (jnp.pad(t, pad) for t in (q, k, v))
    lead = ((0, 0), (1, 0), (0, 0), (0, 0))  # one dummy slot makes the history a full block

    def two_blocks(t, hist):
        """(b, nb * w, ...) -> (b, nb, 2w, ...): each block preceded by the block before it."""
        prev = jnp.concatenate([jnp.pad(hist, lead), t[:, : (nb - 1) * w]], axis=1)
        shape = (b, nb, w, h, hd)
        return jnp.concatenate([prev.reshape(shape), t.reshape(shape)], axis=2)

    keys, vals = two_blocks(kp, hist_k), two_blocks(vp, hist_v)
    # Query i of a block and key j of its (prev | own) pair sit at offsets i and j - w from
    # the block start, so the band i - w < j - w <= i is one static (w, 2w) mask for all blocks.
    i, j = jnp.arange(w)[:, None], jnp.arange(2 * w)[None]
    band = (i < j) & (j <= i + w)
    # Keys before the sequence start (first block's history, position start - w + j < 0) are empty.
    exists = (jnp.arange(nb)[:, None] > 0) | (start - w + jnp.arange(2 * w)[None] >= 0)  # (nb, 2w)
    allowed = band[None] & exists[:, None, :]  # (nb, w, 2w)
    o = attend(qp.reshape(b, nb, w, h, hd), keys, vals, allowed[None, :, None], scale)
    return o.reshape(b, nb * w, h, hd)[:, :l]
