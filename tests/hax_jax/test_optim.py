"""optim.frozen: the named parameters never move, the rest train as without it; an unknown name is
refused when the optimizer is initialised; without frozen names the optimizer state is the one
earlier checkpoints hold."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hax_jax import optim
from hax_jax.config import Config, OptimConfig, apply_overrides

PARAMS = {
    "mixer": {
        "A_log": jnp.log(jnp.arange(1.0, 9.0)),
        "dt_bias": jnp.full((8,), -4.0),
        "in_proj": {"kernel": jnp.ones((4, 8)) * 0.1},
    },
    "embedding": jnp.ones((16, 4)) * 0.02,
}


def train(cfg: OptimConfig, steps: int = 3):
    """`steps` AdamW steps on random gradients; the parameters after them."""
    tx = optim.make_optimizer(cfg, num_steps=10)
    params, state = PARAMS, tx.init(PARAMS)
    for step in range(steps):
        leaves, treedef = jax.tree.flatten(params)
        keys = jax.random.split(jax.random.key(step), len(leaves))
        grads = jax.tree.unflatten(
            treedef, [jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)]
        )
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params


def test_frozen_parameters_never_move_and_the_rest_train_as_without():
    cfg = apply_overrides(Config(), ["optim.frozen=(A_log,dt_bias)", "optim.warmup_steps=1"])
    assert cfg.optim.frozen == ("A_log", "dt_bias")
    frozen = train(cfg.optim)
    free = train(OptimConfig(warmup_steps=1))
    for name in ("A_log", "dt_bias"):
        np.testing.assert_array_equal(frozen["mixer"][name], PARAMS["mixer"][name])
        assert not np.array_equal(free["mixer"][name], PARAMS["mixer"][name])
    # Clipping still sees every gradient (as before), so the others move exactly as without.
    for path in (("mixer", "in_proj", "kernel"), ("embedding",)):
        got, want = frozen, free
        for key in path:
            got, want = got[key], want[key]
        np.testing.assert_array_equal(got, want)


def test_an_unknown_frozen_name_is_refused_at_init():
    tx = optim.make_optimizer(OptimConfig(frozen=("A_log", "A_logg")), num_steps=10)
    with pytest.raises(ValueError, match=r"optim.frozen names \['A_logg'\], which no parameter"):
        tx.init(PARAMS)


@pytest.mark.parametrize("clip_norm", [1.0, 0.0])
def test_without_frozen_names_the_state_is_unchanged(clip_norm):
    """The optimizer state of a run without frozen names keeps the structure it had before the
    option existed, so such runs resume from their checkpoints."""
    cfg = OptimConfig(clip_norm=clip_norm)
    lr = optim.learning_rate(cfg, 10)
    adamw = optax.adamw(lr, weight_decay=cfg.weight_decay, mask=optim.decay_mask)
    before = optax.chain(optax.clip_by_global_norm(clip_norm), adamw) if clip_norm else adamw
    now = optim.make_optimizer(cfg, num_steps=10)
    assert jax.tree.structure(now.init(PARAMS)) == jax.tree.structure(before.init(PARAMS))
