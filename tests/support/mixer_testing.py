"""Helpers shared by the mixer tests: parameters moved off their init, jitted modes, a decode loop."""

import jax
import jax.numpy as jnp
from flax import nnx


def perturbed(module, *, seed: int, scale: float):
    """`module` with every parameter moved off its init (ones, zeros, aranges hide mapping errors)."""
    graphdef, state = nnx.split(module)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


@nnx.jit
def run_parallel(mixer, u, cache=None, seq_idx=None, rng=None):
    """Parallel mode, jitted (eager dispatch of every op is slow on CPU)."""
    return mixer(u, cache=cache, seq_idx=seq_idx, rng=rng)


run_step = nnx.jit(lambda mixer, u, cache: mixer.step(u, cache))


def prefill_then_decode(mixer, u, *, prefix: int, cache=None):
    """Parallel mode over u[:, :prefix] (from `cache`), then one step per remaining token: (y, cache)."""
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
