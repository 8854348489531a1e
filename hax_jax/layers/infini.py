"""Infini-attention ("infini"): per-segment local attention plus a compressive memory.

Munkhdalai et al. 2024, arXiv 2404.07143 v2. The sequence is cut into segments of
N = cfg.infini.segment_len tokens. Per head, with sigma = ELU + 1 on the projected (non-RoPE)
queries and keys:

    A_dot = softmax(Q_r K_r^T / sqrt(head_dim) + causal) V     (Q_r, K_r: RoPE inside the segment)
    A_mem = sigma(Q) M_{s-1} / (sigma(Q) z_{s-1} + eps)             (retrieve, eq. 3)
    A     = sigmoid(beta) A_mem + (1 - sigmoid(beta)) A_dot         (gate, eq. 10)
    linear: M_s = M_{s-1} + sigma(K)^T V                            (eq. 4)
    delta:  M_s = M_{s-1} + sigma(K)^T (V - sigma(K) M_{s-1} / (sigma(K) z_{s-1} + eps))   (eq. 5)
    z_s = z_{s-1} + sum_t sigma(K_t)

Choices the paper leaves open or prints differently:
- the local logits are scaled by 1/sqrt(head_dim) (eq. 6 prints sqrt(d_model); head_dim is the
  standard scaled dot product of each head);
- M_0 = 0 and z_0 = 0, so the first segment's retrieval is 0 / 0: eps = 1e-6 in every denominator
  makes it 0 (and keeps the delta rule's own retrieval finite);
- RoPE positions count from the segment start: local attention never crosses a segment, so only
  relative positions matter, and small angles keep fp32 RoPE exact on long sequences.
A segment is retrieved from before it is written (M_{s-1} first, then M_s).

With the sequence split over the mesh's "seq" axis (hax_jax.parallel; whole segments per shard),
the memory passes between shards: z adds up, and a segment's write is affine in M (linear:
M + sigma(K)^T V; delta, given z: (I - sigma(K)^T U) M + sigma(K)^T V with rows
u_t = sigma(K_t) / (sigma(K_t) z + eps)). Each shard composes its segments' maps, an exclusive
prefix over the shards gives its incoming (M, z), and it scans its segments from there.
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from hax_jax.config import DEFAULT_CAPACITY, ModelConfig
from hax_jax.layers import init
from hax_jax.layers.attention import attend
from hax_jax.layers.rope import apply_rope
from hax_jax.parallel import (
    SEQ,
    from_last_shard,
    from_previous_shard,
    incoming_states,
    per_device,
    received,
    seq_shards,
)

EPS = 1e-6  # the retrieval denominator's guard (see the module docstring)
HEADS = ("batch", "seq", "heads", None)  # q, k, v, outputs: (b, l, h, head_dim)
BUFFER = ("batch", None, "heads", None)  # the cache's partial segment: (b, N, h, head_dim)


class InfiniCache(NamedTuple):
    """Decode state: the memory as of the current segment's start, and that segment's tokens."""

    mem: jax.Array  # (b, h, d_key, d_value) fp32: M_{s-1}
    norm: jax.Array  # (b, h, d_key) fp32: z_{s-1}
    k: jax.Array  # (b, N, h, d_key) compute dtype: the segment's raw (non-RoPE) keys; zeros later
    v: jax.Array  # (b, N, h, d_value) compute dtype: its values
    pos: jax.Array  # () int32: tokens consumed; the current segment holds pos % N of them


def sigma(x: jax.Array) -> jax.Array:
    """The memory's feature map ELU(x) + 1 (positive), in fp32."""
    return jax.nn.elu(x.astype(jnp.float32)) + 1.0


def memory_retrieve(sq: jax.Array, mem: jax.Array, norm: jax.Array) -> jax.Array:
    """sigma(Q) (b, n, h, dk), M (b, h, dk, dv), z (b, h, dk) -> sigma(Q) M / (sigma(Q) z + eps)."""
    num = jnp.einsum("bnhk,bhkv->bnhv", sq, mem)
    den = jnp.einsum("bnhk,bhk->bnh", sq, norm) + EPS
    return num / den[..., None]


def memory_update(mem: jax.Array, norm: jax.Array, sk: jax.Array, v: jax.Array, rule: str):
    """Writes one segment, sigma(K) (b, n, h, dk) and V (b, n, h, dv), into (M, z) by `rule`."""
    v = v.astype(jnp.float32)
    if rule == "delta":  # write only what the memory does not already return for these keys
        v = v - memory_retrieve(sk, mem, norm)
    elif rule != "linear":
        raise ValueError(f"infini.update must be 'linear' or 'delta', got {rule!r}")
    return mem + jnp.einsum("bnhk,bnhv->bhkv", sk, v), norm + jnp.sum(sk, axis=1)


class InfiniAttention(nnx.Module):
    """q/k/v projections -> per head, gated local attention + memory retrieval -> out projection."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        c = cfg.infini
        d, h = cfg.d_model, c.n_heads
        if c.head_dim is None and d % h:
            raise ValueError(
                f"d_model={d} must be a multiple of infini.n_heads={h} (or set infini.head_dim)"
            )
        if c.segment_len < 1:
            raise ValueError(f"infini.segment_len must be positive, got {c.segment_len}")
        hd = c.head_dim or d // h
        self.n_heads, self.head_dim, self.seg, self.rule = h, hd, c.segment_len, c.update
        self.theta, self.scale, self.dtype = c.rope_theta, 1.0 / math.sqrt(hd), jnp.dtype(cfg.dtype)

        linear = functools.partial(init.linear, rngs=rngs, dtype=self.dtype)

        # Heads split over "tensor", as attention; memories are per head, so no communication
        # before o_proj's all-reduce.
        self.q_proj, self.k_proj, self.v_proj = (
            linear(d, h * hd, ("embed", "heads")) for _ in range(3)
        )
        # scaled as mamba's out_proj
        self.o_proj = linear(h * hd, d, ("heads", "embed"), scale=1 / math.sqrt(cfg.n_layer))
        # gate logit per head: starts at 1/2
        self.beta = nnx.Param(jnp.zeros((h,), jnp.float32), logical_axes=("heads",))

    def init_cache(self, batch: int, capacity: int = DEFAULT_CAPACITY) -> InfiniCache:
        """Empty memory, empty segment, position 0; `capacity` is unused (the memory is
        fixed-size)."""
        return self._empty(batch, self.n_heads)

    def _empty(self, batch: int, heads: int) -> InfiniCache:
        """The empty cache of `heads` heads (a device's share of them inside shard_map)."""
        hd, n = self.head_dim, self.seg
        return InfiniCache(
            mem=jnp.zeros((batch, heads, hd, hd), jnp.float32),
            norm=jnp.zeros((batch, heads, hd), jnp.float32),
            k=jnp.zeros((batch, n, heads, hd), self.dtype),
            v=jnp.zeros((batch, n, heads, hd), self.dtype),
            pos=jnp.zeros((), jnp.int32),
        )

    def _qkv(self, x: jax.Array):
        """x (b, l, d) -> raw q, k, v (b, l, h, head_dim)."""
        b, l, _ = x.shape
        x = x.astype(self.dtype)
        return tuple(
            p(x).reshape(b, l, self.n_heads, self.head_dim)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )

    def _mix(self, q, k, v, allowed, q_pos, mem, norm, gate):
        """Queries q (b, lq, h, hd) at segment offsets q_pos against one segment's keys k, v
        (b, N, h, hd) under `allowed` (lq, N), and against the memory -> gated heads, fp32."""
        qr = apply_rope(q, q_pos, self.theta)
        kr = apply_rope(k, jnp.arange(k.shape[1]), self.theta)
        a_dot = attend(qr, kr, v, allowed, self.scale).astype(jnp.float32)
        a_mem = memory_retrieve(sigma(q), mem, norm)
        return gate[:, None] * a_mem + (1.0 - gate[:, None]) * a_dot

    def _out(self, a: jax.Array) -> jax.Array:
        """Heads (..., h, hd) fp32 -> (..., d), concatenated heads through the out projection."""
        return self.o_proj(a.reshape(*a.shape[:-2], -1).astype(self.dtype))

    def __call__(
        self, x: jax.Array, *, cache: InfiniCache | None = None, seq_idx=None, mask=None, rng=None
    ):
        """Parallel mode: x (b, l, d) from `cache` (None = fresh) -> (y (b, l, d), cache after x).

        `mask` (padding) is ignored: padding at the end reaches no real token; `rng` too. A fresh
        start runs per sequence shard (see the module docstring); a continuing one as a whole.
        """
        if seq_idx is not None:
            raise ValueError("the infini mixer does not support seq_idx (packed documents)")
        q, k, v = self._qkv(x)
        gate = jax.nn.sigmoid(self.beta[...])
        if cache is None:
            a, *state = per_device(
                self._fresh,
                dict(q=q, k=k, v=v, gate=gate),
                dict(q=HEADS, k=HEADS, v=HEADS, gate=("heads",)),
                [HEADS, ("batch", "heads", None, None), ("batch", "heads", None), BUFFER, BUFFER],
                seq_aware=True,
            )
            pos = jnp.asarray(x.shape[1], jnp.int32)
        else:
            a, *state = self._scan(q, k, v, gate, cache, cache.pos % self.seg)
            pos = jnp.asarray(cache.pos + x.shape[1], jnp.int32)
        return self._out(a), InfiniCache(*state, pos)

    def _fresh(self, q, k, v, gate):
        """`_scan` from an empty memory; on a sequence shard, from the memory the earlier shards
        wrote (`incoming_memory`) -> (a, M, z, buffered k, v) after the whole sequence."""
        b, l, h, _ = q.shape
        cache = self._empty(b, h)
        if seq_shards() == 1:
            return self._scan(q, k, v, gate, cache, 0)
        if l % self.seg:
            raise ValueError(
                f"each sequence shard holds {l} positions, not a whole number of segments "
                f"(infini.segment_len={self.seg}): the memory passes between shards at segment "
                "boundaries"
            )
        (mem, norm), final = incoming_memory(sigma(k), v, self.seg, self.rule)
        a, _, _, buf_k, buf_v = self._scan(q, k, v, gate, cache._replace(mem=mem, norm=norm), 0)
        return a, *final, buf_k, buf_v

    def _scan(self, q, k, v, gate, cache: InfiniCache, r):
        """q, k, v (b, l, h, hd) after the cache's r = pos % N buffered tokens (a static 0 when
        fresh: no room kept for them) -> (a (b, l, h, hd) fp32, M, z, buffered k, v).

        A scan over segments carries (M, z). The tokens are laid out on the segment grid: the
        cached partial segment's r tokens first, then q/k/v, then zero padding to whole segments.
        """
        b, l, h, hd = q.shape
        n = self.seg
        # A traced r may be anything up to N - 1: the grid keeps room for it.
        total = n * -(-(l + (0 if isinstance(r, int) else n - 1)) // n)
        in_cache = (jnp.arange(n) < r)[None, :, None, None]

        def grid(t, buf=None):
            """(b, l, h, hd) -> (b, total, h, hd): t at offset r, the cached segment before it."""
            out = jnp.zeros((b, total, h, hd), t.dtype)
            out = jax.lax.dynamic_update_slice(out, t, (0, r, 0, 0))
            if buf is None:
                return out
            return out.at[:, :n].set(jnp.where(in_cache, buf.astype(t.dtype), out[:, :n]))

        qg, kg, vg = grid(q), grid(k, cache.k), grid(v, cache.v)
        end = r + l  # grid slots holding tokens
        n_seg = total // n
        complete = (jnp.arange(n_seg) + 1) * n <= end
        causal = jnp.arange(n)[:, None] >= jnp.arange(n)[None]
        rule = self.rule

        @jax.checkpoint  # recompute each segment's attention in the backward pass: O(N) memory each
        def segment(carry, xs):
            """One segment: outputs from M_{s-1}, then M_s (only if the segment is complete)."""
            mem, norm = carry
            qs, ks, vs, full = xs
            a = self._mix(qs, ks, vs, causal, jnp.arange(n), mem, norm, gate)
            # A partial last segment stays in the cache's buffer instead, so neither its tail
            # padding nor its real tokens reach the memory until the segment is whole.
            new_mem, new_norm = memory_update(mem, norm, sigma(ks), vs, rule)
            return (jnp.where(full, new_mem, mem), jnp.where(full, new_norm, norm)), a

        def segments(t):
            """(b, total, h, hd) -> (n_seg, b, N, h, hd), the scan's leading axis."""
            return jnp.moveaxis(t.reshape(b, n_seg, n, h, hd), 1, 0)

        (mem, norm), a = jax.lax.scan(
            segment, (cache.mem, cache.norm), (segments(qg), segments(kg), segments(vg), complete)
        )
        a = jnp.moveaxis(a, 0, 1).reshape(b, total, h, hd)
        a = jax.lax.dynamic_slice_in_dim(a, r, l, axis=1)
        # The new buffer: the partial segment after the last complete one (zeros if there is none).
        start = (end // n) * n
        at = jnp.minimum(start, total - n)  # where dynamic_slice really reads (it clamps)
        slot = at + jnp.arange(n)
        keep = ((slot >= start) & (slot < end))[None, :, None, None]
        buf_k = jnp.where(keep, jax.lax.dynamic_slice_in_dim(kg, at, n, axis=1), 0)
        buf_v = jnp.where(keep, jax.lax.dynamic_slice_in_dim(vg, at, n, axis=1), 0)
        return a, mem, norm, buf_k, buf_v

    def step(self, x: jax.Array, cache: InfiniCache):
        """Recurrent mode, one token: x (b, d) -> (y (b, d), cache); the segment folds into (M, z)
        after its N-th token, with the same update as the parallel mode."""
        n = self.seg
        r = cache.pos % n
        q, k, v = self._qkv(x[:, None])
        buf_k = jax.lax.dynamic_update_slice(cache.k, k.astype(cache.k.dtype), (0, r, 0, 0))
        buf_v = jax.lax.dynamic_update_slice(cache.v, v.astype(cache.v.dtype), (0, r, 0, 0))
        gate = jax.nn.sigmoid(self.beta[...])
        a = self._mix(q, buf_k, buf_v, jnp.arange(n) <= r, r[None], cache.mem, cache.norm, gate)

        def fold(state):
            """Writes the whole segment into the memory and empties the buffer."""
            mem, norm, bk, bv = state
            mem, norm = memory_update(mem, norm, sigma(bk), bv, self.rule)
            return mem, norm, jnp.zeros_like(bk), jnp.zeros_like(bv)

        state = (cache.mem, cache.norm, buf_k, buf_v)
        mem, norm, buf_k, buf_v = jax.lax.cond(r == n - 1, fold, lambda s: s, state)
        return self._out(a[:, 0]), InfiniCache(mem, norm, buf_k, buf_v, cache.pos + 1)


def incoming_memory(sk: jax.Array, v: jax.Array, n: int, rule: str):
    """((M, z) entering this shard, (M, z) after the last shard) from an empty memory, each shard
    writing its whole segments of n tokens (sigma(K) sk, V v: (b, l, h, hd)) by `rule`."""
    b, l, h, dk = sk.shape
    sk_bcshk = sk.reshape(b, l // n, n, h, dk)
    v_bcshv = v.astype(jnp.float32).reshape(b, l // n, n, h, v.shape[-1])
    z_bchk = jnp.sum(sk_bcshk, axis=2)  # each segment's addition to z
    one = jnp.ones((), jnp.float32)
    if rule == "linear":  # eq. 4: writes add up, so M and z pass as one sum (one all-gather)
        writes = jnp.einsum("bcshk,bcshv->bhkv", sk_bcshk, v_bcshv)
        packed = jnp.concatenate([writes, jnp.sum(z_bchk, axis=1)[..., None]], axis=-1)
        before, after = incoming_states(one, packed)
        return (before[..., :-1], before[..., -1]), (after[..., :-1], after[..., -1])
    # Delta (eq. 5): z still adds up; given z at a segment's start its write is affine in M,
    # M -> (I - sigma(K)^T U) M + sigma(K)^T V with rows u_t = sigma(K_t) / (sigma(K_t) z + eps).
    z_in, z_end = incoming_states(one, jnp.sum(z_bchk, axis=1))
    # z at each segment's start: the incoming z plus this shard's earlier segments' additions.
    z_before_bchk = jnp.cumsum(jnp.pad(z_bchk[:, :-1], ((0, 0), (1, 0), (0, 0), (0, 0))), axis=1)
    den_bcsh = jnp.einsum("bcshk,bchk->bcsh", sk_bcshk, z_in[:, None] + z_before_bchk) + EPS
    u_bcshk = sk_bcshk / den_bcsh[..., None]
    eye = jnp.eye(dk, dtype=jnp.float32)
    trans_cbhkj = jnp.moveaxis(eye - jnp.einsum("bcshk,bcshj->bchkj", sk_bcshk, u_bcshk), 1, 0)
    offset_cbhkv = jnp.moveaxis(jnp.einsum("bcshk,bcshv->bchkv", sk_bcshk, v_bcshv), 1, 0)

    def then(acc, seg):
        """The shard's map so far, followed by one more segment's."""
        (trans, offset), (t, o) = acc, seg
        return (t @ trans, t @ offset + o), None

    start = (jnp.broadcast_to(eye, trans_cbhkj.shape[1:]), jnp.zeros_like(offset_cbhkv[0]))
    (trans, offset), _ = jax.lax.scan(then, start, (trans_cbhkj, offset_cbhkv))
    mem_in, mem_end = _incoming_affine(trans, offset)
    return (mem_in, z_in), (mem_end, z_end)


def _incoming_affine(trans: jax.Array, offset: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`incoming_states` for matrix maps M -> trans @ M + offset ((..., k, k), (..., k, v)) from
    M = 0: one all-gather of the shards' maps, then S compositions on every shard. On two shards
    the second enters with the first's offset alone (the map of M = 0): one collective-permute."""
    k = trans.shape[-1]
    if seq_shards() == 2:
        entering = from_previous_shard(offset, jnp.zeros_like(offset))
        return entering, from_last_shard(trans @ entering + offset)
    packed = received(jax.lax.all_gather(jnp.concatenate([trans, offset], axis=-1), SEQ))
    mem, entering = jnp.zeros_like(offset), []
    for s in range(seq_shards()):
        entering.append(mem)
        mem = packed[s, ..., :k] @ mem + packed[s, ..., k:]
    return jnp.stack(entering)[jax.lax.axis_index(SEQ)], mem
