"""Helpers shared by the mixer tests: parameters moved off their init, jitted modes, a decode loop,
and the LM's decode checked against its parallel mode."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hax_jax.models.blocks import MIXERS
from hax_jax.models.lm import LanguageModel


def perturbed(module, *, seed: int, scale: float):
    """`module` with every parameter moved off its init (ones, zeros, aranges hide mapping
    errors)."""
    graphdef, state = nnx.split(module)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


def perturbed_mixer(kind: str, cfg, seed: int = 0):
    """A `kind` mixer of `cfg` with every parameter moved off its init, so structure cannot hide
    errors."""
    return perturbed(MIXERS[kind](cfg, rngs=nnx.Rngs(seed)), seed=seed + 1, scale=0.1)


def assert_trees_close(got, want, tol: dict):
    """Every leaf of two trees (caches) agrees within `tol`."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, **tol)


@nnx.jit
def run_parallel(mixer, u, cache=None, seq_idx=None, rng=None):
    """Parallel mode, jitted (eager dispatch of every op is slow on CPU)."""
    return mixer(u, cache=cache, seq_idx=seq_idx, rng=rng)


run_step = nnx.jit(lambda mixer, u, cache: mixer.step(u, cache))


def prefill_then_decode(mixer, u, *, prefix: int, cache=None):
    """Parallel mode over u[:, :prefix] (from `cache`), then one step per remaining token: (y,
    cache)."""
    y, cache = run_parallel(mixer, u[:, :prefix], cache)
    outs = [y]
    for t in range(prefix, u.shape[1]):
        y_t, cache = run_step(mixer, u[:, t], cache)
        outs.append(y_t[:, None])
    return jnp.concatenate(outs, 1), cache


def random_inputs(b=2, l=19, d=32, seed=0, dtype=jnp.float32):
    """Random mixer inputs (b, l, d)."""
    return jax.random.normal(jax.random.key(seed), (b, l, d), dtype)


lm_logits = nnx.jit(lambda model, tokens: model(tokens))
_lm_forward = nnx.jit(lambda model, tokens, cache: model.forward(tokens, cache=cache))
_lm_step = nnx.jit(lambda model, token, cache: model.step(token, cache))


def lm_prefill_then_decode(model, tokens, *, prefix: int, cache=None):
    """The LM's parallel mode over tokens[:, :prefix] (from `cache`), then one step per remaining
    token: (logits (b, l, V), cache)."""
    logits, cache = _lm_forward(model, tokens[:, :prefix], cache)
    outs = [logits]
    for t in range(prefix, tokens.shape[1]):
        step_logits, cache = _lm_step(model, tokens[:, t], cache)
        outs.append(step_logits[:, None])
    return jnp.concatenate(outs, 1), cache


def assert_lm_decode_equals_parallel(cfg, tol: dict):
    """The LM of `cfg`: 4 tokens prefilled then 9 decoded give the parallel mode's fp32 logits."""
    model = LanguageModel(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(0), (2, 13), 0, cfg.vocab_size)
    full = lm_logits(model, tokens)
    assert full.shape == (2, 13, cfg.padded_vocab_size) and full.dtype == jnp.float32
    decoded, _ = lm_prefill_then_decode(model, tokens, prefix=4)
    np.testing.assert_allclose(decoded, full, **tol)
