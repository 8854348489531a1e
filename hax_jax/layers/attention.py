"""Multi-head causal self-attention with RoPE ("attention") and its sliding-window form ("swa").

Full attention is the quadratic baseline; its decode cache is a preallocated KV buffer of a fixed
capacity. Sliding-window attention (query i sees keys j with i - window < j <= i) runs in blocks
of `window` queries, each against its own block and the previous one, so it costs O(l * window)
and never builds an (l, l) array; its decode cache is a ring buffer of the last window - 1 keys
and values.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from hax_jax.config import DEFAULT_CAPACITY, ModelConfig
from hax_jax.layers.conv import torch_linear_init
from hax_jax.layers.rope import apply_rope
from hax_jax.sharding import linear_axes


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

        def linear(i, o, axes, bias, scale=1.0):
            init = torch_linear_init(i, scale)
            return nnx.Linear(
                i,
                o,
                use_bias=bias,
                dtype=self.dtype,
                kernel_init=init,
                rngs=rngs,
                **linear_axes(*axes),
            )

        # Heads split over "tensor" (the flattened h * head_dim axis, head-aligned when the tensor
        # size divides n_heads); one all-reduce after o_proj.
        self.q_proj = linear(d, h * hd, ("embed", "heads"), a.qkv_bias)
        self.k_proj = linear(d, h * hd, ("embed", "heads"), a.qkv_bias)
        self.v_proj = linear(d, h * hd, ("embed", "heads"), a.qkv_bias)
        # Scaled by 1/sqrt(n_layer), as mamba's out_proj (rescale_prenorm_residual).
        self.o_proj = linear(h * hd, d, ("heads", "embed"), False, scale=1 / math.sqrt(cfg.n_layer))

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
        i = jnp.arange(l)[:, None]
        if cache is None:  # training / first prefill: keys are just these l tokens
            o = attend(q, k, v, i >= jnp.arange(l)[None], self.scale)
            # Hold at least this prefix; later calls must stay within the capacity.
            pad = ((0, 0), (0, max(DEFAULT_CAPACITY, l) - l), (0, 0), (0, 0))
            return o, KVCache(jnp.pad(k, pad), jnp.pad(v, pad), jnp.asarray(l, jnp.int32))
        # Continuing: write the new keys at their positions, then attend over the whole buffer.
        # Past the capacity the write would be clamped; keep p + l <= capacity.
        p = cache.pos
        ck = jax.lax.dynamic_update_slice(cache.k, k.astype(cache.k.dtype), (0, p, 0, 0))
        cv = jax.lax.dynamic_update_slice(cache.v, v.astype(cache.v.dtype), (0, p, 0, 0))
        o = attend(q, ck, cv, jnp.arange(ck.shape[1])[None] <= p + i, self.scale)
        return o, KVCache(ck, cv, p + l)

    def _windowed(self, q, k, v, cache: KVCache | None):
        """Sliding-window attention in blocks of `window` queries against two blocks of keys."""
        b, l, h, hd = q.shape
        w = self.window
        if cache is None:
            cache = self.init_cache(b)
        p = cache.pos
        # The ring buffer in time order: element i holds position p - (w - 1) + i.
        hist_k = jnp.roll(cache.k, -(p % (w - 1)), axis=1)
        hist_v = jnp.roll(cache.v, -(p % (w - 1)), axis=1)
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
        # Keys before the sequence start (first block's history, position p - w + j < 0) are empty.
        exists = (jnp.arange(nb)[:, None] > 0) | (p - w + jnp.arange(2 * w)[None] >= 0)  # (nb, 2w)
        allowed = band[None] & exists[:, None, :]  # (nb, w, 2w)
        o = attend(qp.reshape(b, nb, w, h, hd), keys, vals, allowed[None, :, None], self.scale)
        o = o.reshape(b, nb * w, h, hd)[:, :l]
        # The new cache: the last w - 1 tokens in time order, laid out as the ring buffer.
        end = p + l
        last_k = jnp.concatenate([hist_k, k.astype(hist_k.dtype)], axis=1)[:, -(w - 1) :]
        last_v = jnp.concatenate([hist_v, v.astype(hist_v.dtype)], axis=1)[:, -(w - 1) :]
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
