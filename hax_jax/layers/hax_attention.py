"""The sparse-attention branch beside an SSM mixer (HAX paper §4; SPEC §1.3).

On the post-conv activation x (b, l, e): [K | Q] = qk_proj(x), K /= sqrt(N), V = x; o =
sparse_attention(Q, K, V) over the configured pattern ("lsh+ks" is HAX); the mixer adds o * E (E a
learned per-channel gate, init 1). The key-selection scorer is an MLP on [stopgrad(k_j),
normalize(sum_{p<=j} stopgrad(q_p))], trained only by the ranking loss (paper eqs. 15-17), which is
sown as `nnx.Intermediate` "rank_loss" when an rng is given (collect it with `nnx.capture(model,
nnx.Intermediate)`; see models.lm.rank_loss_sum).
"""

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from hax_jax.config import ModelConfig
from hax_jax.layers import init
from hax_jax.parallel import per_device, received, top_k_over_sequence
from hax_jax.parallel_sparse import sequence_cumsum, sparse_attention_sequence_parallel
from hax_jax.sharding import shard
from pallas_kernels.sparse_attention import (
    LinearScore,
    SparseAttentionCache,
    init_cache,
    prefill_cache,
    sparse_attention_step,
)
from pallas_kernels.sparse_attention.spec import selected

# The logical axes of each argument of the parallel op
# (parallel_sparse.sparse_attention_sequence_parallel) and of its output: a device attends for its
# batch rows and its slice of e (q, k whole); a split "seq" is the op's own to combine.
ATTEND_AXES = {
    "q": ("batch", "seq", None),
    "k": ("batch", "seq", None),
    "v": ("batch", "seq", "inner"),
    "hash_proj": (None, None),
    "key_scores": ("batch", "seq"),
}
ATTEND_OUT_AXES = [("batch", "seq", "inner")]


def l2_normalize(x: jax.Array, axis: int = -1) -> jax.Array:
    """x / max(||x||, 1e-12) along `axis` (torch.nn.functional.normalize)."""
    return x / jnp.maximum(jnp.linalg.norm(x, axis=axis, keepdims=True), 1e-12)


def ranking_loss(scores_bl, q_bln, k_bln, candidates_bc, mask_bl=None) -> jax.Array:
    """Paper eqs. 15-17 on kc candidate keys per sequence: mean_{a,b} BCE(x_a - x_b, T_ab).

    x_j = scores[j]; target y_j = sum_{i >= j} sigmoid(q_i . k_j) (stop-gradient);
    T_ab = 1 if y_a > y_b, 0.5 if equal, 0 otherwise. Costs O(l * kc * n): no (l x l) array.
    With `mask_bl` (real tokens), padding neither is a candidate pair member nor counts as a query
    in the targets (the official code sums over padded queries too).
    """
    l = q_bln.shape[1]
    # What is gathered or summed across positions (x, y, valid) is named as received: on a split
    # sequence each is an all-reduce, which a rematerialised block keeps rather than reruns in its
    # backward. Rerun, they are independent across blocks, so XLA:GPU may join them into one that
    # waits on every block's recompute (presumably why HAX 64K on seq=2 held 17.4 GiB of
    # temporaries a GPU with all-reduces joined, 10.2 with none joined).
    x_bc = received(jnp.take_along_axis(scores_bl.astype(jnp.float32), candidates_bc, axis=1))
    k_bcn = jnp.take_along_axis(k_bln.astype(jnp.float32), candidates_bc[..., None], axis=1)
    logits_blc = jnp.einsum("bln,bcn->blc", q_bln.astype(jnp.float32), k_bcn)
    later_blc = jnp.arange(l)[None, :, None] >= candidates_bc[:, None, :]
    if mask_bl is not None:
        later_blc = later_blc & mask_bl[:, :, None]
    y_bc = received(
        jax.lax.stop_gradient(
            jnp.sum(jnp.where(later_blc, jax.nn.sigmoid(logits_blc), 0.0), axis=1)
        )
    )
    target_bcc = jnp.where(y_bc[:, :, None] > y_bc[:, None, :], 1.0, 0.0)
    target_bcc = jnp.where(y_bc[:, :, None] == y_bc[:, None, :], 0.5, target_bcc)
    pair_bcc = x_bc[:, :, None] - x_bc[:, None, :]
    # BCE with logits, stable: max(p, 0) - p t + log(1 + exp(-|p|)).
    bce_bcc = (
        jnp.maximum(pair_bcc, 0) - pair_bcc * target_bcc + jnp.log1p(jnp.exp(-jnp.abs(pair_bcc)))
    )
    if mask_bl is None:
        return jnp.mean(bce_bcc)
    valid_bc = received(jnp.take_along_axis(mask_bl, candidates_bc, axis=1))
    pairs_bcc = (valid_bc[:, :, None] & valid_bc[:, None, :]).astype(jnp.float32)
    return jnp.sum(bce_bcc * pairs_bcc) / jnp.maximum(jnp.sum(pairs_bcc), 1.0)


class KeyScorer(nnx.Module):
    """s_j = MLP([k_j, normalize(sum_{p<=j} q_p)]): 2N -> 2N -> 2N -> 1 with ReLU (paper §4.2)."""

    def __init__(self, d_state: int, *, rngs: nnx.Rngs):
        # Small (2N wide): replicated; biased, both inits PyTorch's, computed in fp32.
        width = 2 * d_state
        linear = functools.partial(
            init.linear, width, rngs=rngs, use_bias=True, bias_init=init.torch_linear_init(width)
        )
        self.fc1, self.fc2, self.fc3 = (
            linear(width, ("state", "state")),
            linear(width, ("state", "state")),
            linear(1, ("state", None)),
        )

    def __call__(self, k: jax.Array, q_sum: jax.Array) -> jax.Array:
        """k, q_sum (..., N) (q_sum already normalised) -> scores (...,) fp32; no gradient to k or
        q."""
        return self.fc3(self._hidden(k, q_sum))[..., 0]

    def linear_score(self, k: jax.Array, q_sum: jax.Array) -> LinearScore:
        """The scores as the last layer still to apply: the decode step's kernel applies it (one
        GEMV and one bias kernel fewer a layer and token)."""
        rows, bias = self.fc3.rows()  # (1, 2N), (1,)
        return LinearScore(self._hidden(k, q_sum), rows[0], bias[0])

    def _hidden(self, k: jax.Array, q_sum: jax.Array) -> jax.Array:
        """The input of the last layer, (..., 2N) fp32."""
        h = jnp.concatenate([jax.lax.stop_gradient(k), jax.lax.stop_gradient(q_sum)], axis=-1)
        h = jax.nn.relu(self.fc1(h.astype(jnp.float32)))
        return jax.nn.relu(self.fc2(h))


class HaxBranch(nnx.Module):
    """qk projection, the sparse attention over (Q, K, V = x), the per-channel gate E, and the
    scorer."""

    def __init__(self, cfg: ModelConfig, *, d_inner: int, d_state: int, rngs: nnx.Rngs):
        # The attention is described once, by the spec every op call below takes.
        self.cfg, self.spec = cfg.sparse, cfg.sparse.spec
        self.d_state, self.d_inner = d_state, d_inner
        # q/k contract the split d_inner: one more all-reduce under tensor parallelism (SPEC §3).
        self.qk_proj = init.linear(
            d_inner, 2 * d_state, ("inner", "state"), rngs=rngs, dtype=jnp.dtype(cfg.dtype)
        )
        self.E = nnx.Param(jnp.ones((d_inner,), jnp.float32), logical_axes=("inner",))
        self.scorer = KeyScorer(d_state, rngs=rngs) if self.spec.has("ks") else None

    def _qk(self, x: jax.Array):
        """x (..., e) -> q, k (..., N), with K scaled by 1/sqrt(N)."""
        k, q = jnp.split(self.qk_proj(x), 2, axis=-1)
        return q, k / math.sqrt(self.d_state)

    def _hash_proj(self, rng: jax.Array | None) -> jax.Array | None:
        """H ~ N(0, 1) (N, h): resampled from `rng` in training, fixed by eval_hash_seed
        otherwise."""
        if not self.spec.has("lsh"):
            return None
        key = jax.random.key(self.cfg.eval_hash_seed) if rng is None else rng
        return jax.random.normal(key, (self.d_state, self.spec.hash_bits), jnp.float32)

    def _key_scores(self, q_bln: jax.Array, k_bln: jax.Array) -> jax.Array | None:
        """Scores of every key from the causal prefix sum of queries (the official code:
        sequence-normalised)."""
        if self.scorer is None:
            return None
        q_sum = sequence_cumsum(q_bln)
        # The official code calls normalize() with torch's default dim=1, the sequence axis: it
        # leaks the future into every score. We normalise each prefix sum over its own features.
        q_sum = l2_normalize(q_sum, axis=1 if self.cfg.official_code else -1)
        return self.scorer(k_bln, q_sum)

    def __call__(
        self,
        x: jax.Array,
        *,
        mask: jax.Array | None = None,
        rng: jax.Array | None = None,
        gated: bool = True,
    ):
        """Parallel mode: x (b, l, e) -> o * E (b, l, e), or o where not `gated` (the caller
        applies E: Mamba-2's gated norm takes it in its kernels); with `rng`, sows the ranking
        loss."""
        q, k = self._qk(x)
        hash_rng, rank_rng = (None, None) if rng is None else jax.random.split(rng)
        scores = self._key_scores(q, k)
        o = self._attend(q, k, x, self._hash_proj(hash_rng), scores)
        if rng is not None and scores is not None:
            self.sow(nnx.Intermediate, "rank_loss", self._rank_loss(scores, q, k, mask, rank_rng))
        return o * self.E[...].astype(o.dtype) if gated else o

    def _attend(self, q, k, x, hash_proj, scores) -> jax.Array:
        """The sub-quadratic op: q, k (b, l, N), V = x (b, l, e), scores (b, l) -> o (b, l, e),
        per device under a mesh (see ATTEND_AXES)."""
        attend = functools.partial(
            sparse_attention_sequence_parallel, spec=self.spec, impl=self.cfg.impl
        )
        key_scores = None if scores is None else jax.lax.stop_gradient(scores)
        args = dict(q=q, k=k, v=x, hash_proj=hash_proj, key_scores=key_scores)
        return per_device(attend, args, ATTEND_AXES, ATTEND_OUT_AXES, seq_aware=True)

    def _rank_loss(self, scores, q, k, mask, rng) -> jax.Array:
        """Samples kc candidate keys per sequence uniformly without replacement (never padding) and
        ranks them."""
        b, l = scores.shape
        kc = min(self.spec.keys_per_component, l)
        # Drawn split as the sequence is (the same values: jax's random bits are partitionable),
        # and ranked shard by shard: no device holds the whole row's noise.
        noise = shard(jax.random.uniform(rng, (b, l)), "batch", "seq")
        if mask is not None:
            noise = jnp.where(mask, noise, -1.0)
        _, candidates = top_k_over_sequence(noise, kc)
        return ranking_loss(scores, q, k, selected(candidates), mask)

    def forward(self, x: jax.Array, cache, *, mask=None, rng=None):
        """Parallel mode inside a mixer, x (b, l, e) and the mixer's cache (or None) -> (o * E, the
        sparse cache or None).

        Without a cache: the sub-quadratic op (training). From a fresh cache (t concretely 0, as
        an init_cache made inside the jit has): `prefill`, the same op in eval mode plus the cache
        built in parallel. Else (a continued, chunked prefill, or a t traced across a jit
        boundary): the step scan from the mixer cache's `sparse` part.
        """
        if cache is None:
            return self(x, mask=mask, rng=rng), None
        sparse = self.decode_cache(cache)
        _check_capacity(x.shape[1], sparse)
        # official_code has no step mode: the scan keeps raising its error.
        if _is_fresh(sparse) and not self.cfg.official_code:
            return self.prefill(x, sparse)
        return self.scan(x, sparse)

    def prefill(self, x: jax.Array, cache: SparseAttentionCache):
        """From an empty cache: x (b, l, e) -> (o * E (b, l, e), cache after x) as the step scan
        gives them, but from the parallel op (eval mode) and `prefill_cache`: no loop over
        tokens."""
        q, k = self._qk(x)
        scores = self._key_scores(q, k)
        hash_proj = self._hash_proj(None)
        o = self._attend(q, k, x, hash_proj, scores)
        cache = prefill_cache(
            q, k, x, cache, spec=self.spec, hash_proj=hash_proj, key_scores=scores
        )
        return o * self.E[...].astype(o.dtype), cache

    # ------------------------------------------------------------------ decode

    @staticmethod
    def decode_cache(cache) -> SparseAttentionCache:
        """The branch's part of a mixer cache, or a clear error when that cache did not start as
        init_cache."""
        if cache.sparse is None:
            raise ValueError(
                "this layer has a sparse-attention branch: start from model.init_cache(batch) "
                "(pass cache= to the prefill) before decoding step by step"
            )
        return cache.sparse

    def init_cache(self, batch: int, capacity: int, dtype) -> SparseAttentionCache:
        """An empty decode cache holding up to `capacity` tokens."""
        return init_cache(batch, capacity, self.d_state, self.d_inner, spec=self.spec, dtype=dtype)

    def step(self, x: jax.Array, cache):
        """Recurrent mode inside a mixer, x (b, e) and the mixer's cache (as `forward` takes it) ->
        (o * E (b, e), the sparse cache); O(num_keys * (N + e)) per token."""
        return self._step(x, self.decode_cache(cache))

    def _step(self, x: jax.Array, cache: SparseAttentionCache):
        """One token against the branch's own cache -> (o * E (b, e), the cache after it)."""
        if self.cfg.official_code:
            raise ValueError("sparse.official_code=True is non-causal and has no step mode")
        q, k = self._qk(x)
        score = None
        if self.scorer is not None:
            score = self.scorer.linear_score(k, l2_normalize(cache.q_sum + q.astype(jnp.float32)))
        o, cache = sparse_attention_step(
            q,
            k,
            x,
            cache,
            spec=self.spec,
            hash_proj=self._hash_proj(None),
            key_score=score,
            impl=self.cfg.impl,
        )
        return o * self.E[...].astype(o.dtype), cache

    def scan(self, x: jax.Array, cache: SparseAttentionCache):
        """Prefill from a cache: the step over every token of x (b, l, e), as one lax.scan."""

        def body(cache, x_t):
            o_t, cache = self._step(x_t, cache)
            return cache, o_t

        cache, o_lbe = jax.lax.scan(body, cache, jnp.moveaxis(x, 1, 0))
        return jnp.moveaxis(o_lbe, 0, 1), cache


def sparse_branch(cfg: ModelConfig, *, d_inner: int, d_state: int, rngs: nnx.Rngs):
    """The HAX sparse-attention branch when cfg.sparse.pattern is set, else None."""
    return (
        HaxBranch(cfg, d_inner=d_inner, d_state=d_state, rngs=rngs) if cfg.sparse.pattern else None
    )


def _is_fresh(cache: SparseAttentionCache) -> bool:
    """Whether the cache is known to be empty: t concrete (not a jit tracer) and 0."""
    return not isinstance(cache.t, jax.core.Tracer) and int(cache.t) == 0


def _check_capacity(l: int, cache: SparseAttentionCache) -> None:
    """ValueError naming both when l more tokens do not fit the cache (the step would give NaN)."""
    capacity = cache.keys.shape[1]
    t = 0 if isinstance(cache.t, jax.core.Tracer) else int(cache.t)  # a traced t: at least 0
    if t + l > capacity:
        raise ValueError(
            f"prefill of l = {l} tokens after t = {t} does not fit the sparse cache's "
            f"capacity = {capacity}: pass a larger capacity to model.init_cache(batch, capacity)"
        )


def init_qk_from_bc(x_proj_kernel: jax.Array, *, dt_rank: int, d_state: int) -> jax.Array:
    """Mamba-1 x_proj kernel (e, R + 2N) -> qk_proj kernel (e, 2N) = [B | C] (key <- B, query <- C).

    By state-space duality the SSM's C plays the query and B the key (HAX paper App. D.2).
    """
    return jnp.concatenate(
        [x_proj_kernel[:, dt_rank : dt_rank + d_state], x_proj_kernel[:, dt_rank + d_state :]],
        axis=1,
    )
