"""optim.frozen: the named parameters never move, the rest train as without it; an unknown name is
refused when the optimizer is initialised; without frozen names the optimizer state is the one
earlier checkpoints hold."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from hax_jax import optim
from hax_jax.config import (
    Config,
    Mamba2Config,
    MambaConfig,
    ModelConfig,
    OptimConfig,
    apply_overrides,
)
from hax_jax.models.lm import LanguageModel

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


def test_a_dotted_frozen_name_matches_the_paths_end_only():
    """dt_proj.bias freezes Mamba's dt bias, no other bias (a bare "bias" names them all)."""
    params = {
        "mixer": {
            "dt_proj": {"bias": jnp.full((8,), -4.0), "kernel": jnp.ones((2, 8))},
            "conv1d": {"bias": jnp.zeros((8,)), "kernel": jnp.ones((4, 8))},
        }
    }
    mask = optim.frozen_mask(("dt_proj.bias",))(params)
    assert mask == {
        "mixer": {
            "dt_proj": {"bias": True, "kernel": False},
            "conv1d": {"bias": False, "kernel": False},
        }
    }
    with pytest.raises(ValueError, match=r"\['conv1d.weight'\]"):
        optim.frozen_mask(("dt_proj.bias", "conv1d.weight"))(params)


@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_weight_decay_applies_to_every_kernel_and_part_and_the_embedding(kind):
    """Per SPEC §5: decay on every matrix, the parts of a kernel stored part by part
    (layers/fused.py) included; none on A_log, D, dt_bias, norms, biases."""
    cfg = ModelConfig(
        d_model=16,
        n_layer=1,
        vocab_size=32,
        block_pattern=(kind,),
        mamba=MambaConfig(d_state=4),
        mamba2=Mamba2Config(d_state=4, headdim=8),
    )
    params = nnx.to_pure_dict(nnx.state(LanguageModel(cfg, rngs=nnx.Rngs(0)), nnx.Param))
    paths = jax.tree_util.tree_flatten_with_path(optim.decay_mask(params))[0]
    decayed = {"/".join(str(getattr(k, "key", k)) for k in path): hit for path, hit in paths}
    for name, hit in decayed.items():
        leaf_is_kernel = "/kernel" in name or name.startswith("embedding")
        assert hit == leaf_is_kernel, name
    assert any(hit and "/in_proj/kernel/" in name for name, hit in decayed.items())
