"""The language model: embeddings -> residual blocks -> final RMSNorm -> tied or separate head."""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hax_jax.config import DEFAULT_CAPACITY, ModelConfig
from hax_jax.layers import SCAN_IO
from hax_jax.layers.init import hax_code_init
from hax_jax.layers.norms import RMSNorm
from hax_jax.models.blocks import ResidualBlock
from hax_jax.parallel import CARRIED
from hax_jax.sharding import linear_axes, shard
from pallas_kernels.sparse_attention.spec import SELECTION
from pallas_kernels.ssd import CHUNK_STATES


def rank_loss_sum(intermediates) -> jax.Array:
    """Sum over layers of the sparse branches' ranking losses, from `nnx.capture(model,
    nnx.Intermediate)`.

    Training adds cfg.sparse.rank_loss_weight times this to the task loss (HAX paper eq. 18).
    """
    return sum((jnp.sum(x) for x in jax.tree.leaves(intermediates)), jnp.zeros((), jnp.float32))


def _block(layer: ResidualBlock, x, cache, seq_idx, mask, rng):
    """One residual block in parallel mode, as a function of the block (what nnx.remat wraps)."""
    return layer(x, cache=cache, seq_idx=seq_idx, mask=mask, rng=rng)


# Saves inside a block only what it received from other sequence shards (small: states, halos,
# carried keys), so the recompute runs no collective, and the sparse branch's selection (the
# kernels' layout, the ranking loss's candidates: a few int32 arrays of the row's length), so it
# redoes no bucket, sort or top-k: the backward keeps each block's input (the residual stream,
# b x l x d) and recomputes the rest. Saving the matmul outputs too
# (dots_with_no_batch_dims_saveable) would keep in_proj's outputs (b, l, 2e + 2gn + h), several
# times the residual, at every layer: the memory remat is there to save.
# nnx.remat (not jax.checkpoint) carries the sown ranking loss out to nnx.capture.
# "block_keep_scan" saves as well what the mixers' GEMMs and scans made (layers.SCAN_IO, the SSD's
# chunk states): the backward reruns neither, only the elementwise work between them.
_REMAT_BLOCK = {
    "block": nnx.remat(
        _block, policy=jax.checkpoint_policies.save_only_these_names(CARRIED, SELECTION)
    ),
    "block_keep_scan": nnx.remat(
        _block,
        policy=jax.checkpoint_policies.save_only_these_names(
            CARRIED, SELECTION, SCAN_IO, CHUNK_STATES
        ),
    ),
}


class LanguageModel(nnx.Module):
    """A causal LM over int tokens (b, l); logits (b, l, padded_vocab_size) in fp32."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embedding = nnx.Embed(
            cfg.padded_vocab_size,
            cfg.d_model,
            dtype=jnp.dtype(cfg.dtype),
            embedding_init=nnx.initializers.normal(0.02),
            embedding_metadata={"logical_axes": ("vocab", "embed")},
            rngs=rngs,
        )
        self.layers = nnx.List([ResidualBlock(kind, cfg, rngs=rngs) for kind in cfg.mixer_kinds])
        self.norm_f = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = (
            None
            if cfg.tie_embeddings
            else nnx.Linear(
                cfg.d_model,
                cfg.padded_vocab_size,
                use_bias=False,
                dtype=jnp.dtype(cfg.dtype),
                rngs=rngs,
                **linear_axes("embed", "vocab"),
            )
        )
        if cfg.init == "hax_code":
            hax_code_init(self, cfg.mixer_kinds, rngs.params())

    def __call__(self, tokens: jax.Array, *, seq_idx=None, mask=None, rng=None) -> jax.Array:
        """tokens (b, l) int -> logits (b, l, padded_vocab_size) fp32.

        `mask` (b, l) marks real tokens (padding is False); `rng` switches training behaviour on
        (the sparse branch resamples its hash projection and sows its ranking loss as
        nnx.Intermediate).
        """
        return self.forward(tokens, seq_idx=seq_idx, mask=mask, rng=rng)[0]

    def init_cache(self, batch: int, capacity: int = DEFAULT_CAPACITY) -> tuple:
        """Per-layer caches at the start of a sequence, with room for `capacity` tokens."""
        return tuple(layer.mixer.init_cache(batch, capacity) for layer in self.layers)

    def forward(
        self, tokens: jax.Array, *, cache: tuple | None = None, seq_idx=None, mask=None, rng=None
    ):
        """Parallel mode from `cache` (or a fresh start): tokens (b, l) -> (logits, cache after
        them).

        Used for training (cache ignored), prefill and chunked prefill.
        """
        h, caches = self.hidden(tokens, cache=cache, seq_idx=seq_idx, mask=mask, rng=rng)
        return shard(self.head(h), "batch", "seq", "vocab"), caches

    def hidden(
        self, tokens: jax.Array, *, cache: tuple | None = None, seq_idx=None, mask=None, rng=None
    ):
        """`forward` short of the head: tokens (b, l) -> (norm_f output (b, l, d), cache).

        The loss takes this and `head` to compute logits a chunk of positions at a time.
        """
        tokens = self._check_tokens(tokens, ndim=2)
        block = _REMAT_BLOCK.get(self.cfg.remat_mode(tokens.shape[1]), _block)
        # Block boundaries carry the residual stream as (batch, seq, embed) under the current mesh.
        x = shard(self._embed(tokens), "batch", "seq", "embed")
        rngs = (
            [None] * len(self.layers)
            if rng is None
            else list(jax.random.split(rng, len(self.layers)))
        )
        caches = []
        for i, layer in enumerate(self.layers):
            layer_cache = None if cache is None else cache[i]
            x, layer_cache = block(layer, x, layer_cache, seq_idx, mask, rngs[i])
            x = shard(x, "batch", "seq", "embed")
            caches.append(layer_cache)
        return shard(self._final_norm(x), "batch", "seq", "embed"), tuple(caches)

    def head(self, h: jax.Array) -> jax.Array:
        """Final hidden states (..., d) from `hidden` -> logits (..., padded_vocab_size) in fp32."""
        fn, params = self.head_function()
        return fn(params, h)

    def head_function(self) -> tuple[Callable, dict]:
        """(fn, params): `head` as a pure function fn(params, h) of its parameters (the
        embedding's when tied), for a loss that takes their gradient itself
        (`hax_jax.loss.weighted_nll`)."""
        tied = self.lm_head is None
        # Anything beside the parameters (nnx.capture's slot for sown values) stays as it is.
        graphdef, state, rest = nnx.split(self.embedding if tied else self.lm_head, nnx.Param, ...)

        def fn(params: dict, h: jax.Array) -> jax.Array:
            module = nnx.merge(graphdef, params, rest)
            return (module.attend(h) if tied else module(h)).astype(jnp.float32)

        return fn, nnx.to_pure_dict(state)

    def step(self, tokens: jax.Array, cache: tuple):
        """Recurrent mode, one token per row: tokens (b,) -> (logits (b, V), cache)."""
        tokens = self._check_tokens(tokens, ndim=1)
        x = self._embed(tokens)
        caches = []
        for layer, layer_cache in zip(self.layers, cache, strict=True):
            x, layer_cache = layer.step(x, layer_cache)
            caches.append(layer_cache)
        return self.head(self._final_norm(x)), tuple(caches)

    def _embed(self, tokens: jax.Array) -> jax.Array:
        """Token embeddings, in the residual dtype."""
        # The table whole along d_model at the lookup: FSDP splits it over "data" and "seq", and
        # GSPMD would replicate a table split along its rows' width before gathering rows from it
        # (with a warning); this is FSDP's all-gather at use (in the compute dtype), a no-op
        # without FSDP.
        table = self.embedding.embedding[...].astype(jnp.dtype(self.cfg.dtype))
        x = jnp.take(shard(table, "vocab", None), tokens, axis=0)
        return x.astype(jnp.float32) if self.cfg.residual_in_fp32 else x

    def _final_norm(self, x: jax.Array) -> jax.Array:
        """The residual stream through norm_f, in the compute dtype (the head's input)."""
        return self.norm_f(x).astype(jnp.dtype(self.cfg.dtype))

    def _check_tokens(self, tokens, *, ndim: int) -> jax.Array:
        """tokens as a jax array, checked: shape and dtype always, the id range too when the values
        are concrete (not under jit). Lists and numpy arrays are accepted: users pass them."""
        if not isinstance(tokens, jax.Array):
            try:
                tokens = np.asarray(tokens)
            except ValueError:  # ragged lists
                raise ValueError(
                    f"tokens must be an integer array, got {type(tokens).__name__} {tokens!r:.80}"
                ) from None
        if not jnp.issubdtype(tokens.dtype, jnp.integer) or tokens.ndim != ndim:
            raise ValueError(
                f"tokens must be integer with {ndim} axes, got {tokens.dtype} {tokens.shape}"
            )
        if isinstance(tokens, jax.core.Tracer) or tokens.size == 0:
            return jnp.asarray(tokens)
        values = np.asarray(tokens)
        lo, hi = int(values.min()), int(values.max())
        if lo < 0 or hi >= self.cfg.vocab_size:
            bad = hi if hi >= self.cfg.vocab_size else lo
            raise ValueError(
                f"token id {bad} is out of range [0, vocab_size={self.cfg.vocab_size})"
            )
        return jnp.asarray(tokens)
