"""Logical-axis sharding: every parameter annotated, the mesh, placement, and sharded == one device.

Runs on the 8 simulated CPU devices of tests/conftest.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hax_jax import sharding
from hax_jax.config import (
    AttentionConfig,
    InfiniConfig,
    Mamba2Config,
    MambaConfig,
    MeshConfig,
    ModelConfig,
    SparseConfig,
)
from hax_jax.models.lm import LanguageModel, rank_loss_sum

RTOL = 1e-4  # fp32: max |sharded - single| / max |single|, per array
B, L = 4, 32
# The 8 simulated CPU devices of conftest.py, also on a machine with an accelerator.
CPUS = jax.devices("cpu")
# Both sides of every comparison compile alike; LLVM's optimisations cost 2-3x the compile time of
# these one-shot programs on CPU and would dominate the file's run time.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _cfg(pattern: tuple[str, ...], sparse: str = "", **kw) -> ModelConfig:
    """A tiny LM (d_model 64) with small heads, chunks, windows and segments so l = 64 spans
    several."""
    return ModelConfig(
        d_model=64,
        n_layer=len(pattern),
        vocab_size=120,  # padded to 120: divisible by tensor = 2
        block_pattern=pattern,
        tie_embeddings=kw.pop("tie_embeddings", True),
        mamba=MambaConfig(d_state=8),
        mamba2=Mamba2Config(d_state=16, headdim=16, chunk_size=16),
        sparse=SparseConfig(pattern=sparse, num_keys=16, hash_bits=3),
        attention=AttentionConfig(n_heads=4, window=16),
        infini=InfiniConfig(n_heads=4, segment_len=16),
        **kw,
    )


@pytest.fixture(scope="module")
def mesh():
    return sharding.make_mesh(MeshConfig(data=2, seq=2, tensor=2), CPUS)


def test_every_param_has_logical_axes():
    cfg = _cfg(
        ("mamba", "mamba2", "attention", "swa", "mlp", "infini"), "lsh+ks", tie_embeddings=False
    )
    state = nnx.state(nnx.eval_shape(lambda: LanguageModel(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    flat = nnx.to_flat_state(state)
    names = {"/".join(map(str, path)) for path, _ in flat}
    # The sparse branch with its scorer sits in the mamba and the mamba2 layer; the head is
    # separate.
    for must in (
        "layers/0/mixer/branch/scorer/fc3/kernel",
        "layers/1/mixer/branch/E",
        "lm_head/kernel",
    ):
        assert must in names
    known = dict(sharding.RULES)
    for path, var in flat:
        axes = var.get_metadata().get("logical_axes")
        assert axes is not None and len(axes) == len(var.shape), (path, var.shape, axes)
        assert all(a is None or a in known for a in axes), (path, axes)
    # The pure-dict form (the training code's params) maps path for path.
    axes_dict = sharding.logical_axes_dict(state)
    in_proj = axes_dict["layers"][1]["mixer"]["in_proj"]["kernel"]  # mamba2: stored per part
    assert in_proj == {
        "z": ("embed", "inner"),
        "x": ("embed", "inner"),
        "dt": ("embed", "heads"),
        "B": ("embed", "groups", "state"),
        "C": ("embed", "groups", "state"),
    }
    assert jax.tree.structure(nnx.to_pure_dict(state)) == jax.tree.structure(
        sharding.param_shardings_dict(state, sharding.make_mesh(MeshConfig(), CPUS))
    )


def test_missing_logical_axes_names_the_param(mesh):
    state = nnx.state(nnx.List([nnx.Linear(4, 4, use_bias=False, rngs=nnx.Rngs(0))]), nnx.Param)
    with pytest.raises(ValueError, match="parameter '0/kernel' .*no logical_axes"):
        sharding.param_shardings(state, mesh)


@pytest.mark.parametrize(
    "sizes, message",
    [
        ({"data": 2, "seq": 2, "tensor": 4}, "data=2 x seq=2 x tensor=4 = 16 devices, but only 8"),
        ({"data": -1, "seq": -1, "tensor": 1}, "at most one mesh size may be -1"),
        ({"data": -1, "seq": 3, "tensor": 1}, "product 3 does not divide the 8"),
        ({"data": 0, "seq": 1, "tensor": 8}, "positive or -1, got data=0"),
    ],
)
def test_make_mesh_errors(sizes, message):
    with pytest.raises(ValueError, match=message):
        sharding.make_mesh(MeshConfig(**sizes), CPUS)


def test_make_mesh_resolves_minus_one():
    mesh = sharding.make_mesh(MeshConfig(data=-1, seq=2, tensor=2), CPUS)
    assert dict(mesh.shape) == {"data": 2, "seq": 2, "tensor": 2}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    assert dict(sharding.make_mesh(MeshConfig(), CPUS[:1]).shape) == {
        "data": 1,
        "seq": 1,
        "tensor": 1,
    }
    # In one process, a mesh smaller than the devices takes the first ones.
    small = sharding.make_mesh(MeshConfig(data=2, seq=1, tensor=2), CPUS)
    assert list(small.devices.flat) == CPUS[:4]


def test_logical_to_spec(mesh):
    spec = sharding.logical_to_spec
    assert spec(("embed", "inner"), (64, 256), mesh) == P(None, "tensor")
    assert spec(("embed", "inner"), (64, 257), mesh) == P(None, None)  # odd width: replicated
    assert spec(("inner", "heads"), (8, 8), mesh) == P("tensor", None)  # a mesh axis once
    # FSDP: d_model over "data" and "seq" (both hold whole replicas otherwise).
    assert spec(("embed", "inner"), (64, 256), mesh, sharding.rules(fsdp=True)) == P(
        ("data", "seq"), "tensor"
    )
    with pytest.raises(ValueError, match="unknown logical axis 'nope'"):
        spec(("nope",), (4,), mesh)


def test_shard_is_a_no_op_without_a_mesh(mesh):
    x = np.ones((4, 8, 64), np.float32)
    assert sharding.shard(x, "batch", "seq", "embed") is x
    with jax.set_mesh(mesh):
        y = jax.jit(lambda x: sharding.shard(x * 2, "batch", "seq", "embed"))(x)
    assert y.sharding.spec == P("data", "seq")


@pytest.mark.parametrize("fsdp", [False, True])
def test_params_are_placed_sharded(mesh, fsdp):
    cfg = _cfg(("mamba2",), tie_embeddings=False)
    with jax.default_device(CPUS[0]):
        model = LanguageModel(cfg, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    shardings = sharding.param_shardings_dict(
        nnx.state(model, nnx.Param), mesh, sharding.rules(fsdp)
    )
    placed = jax.device_put(params, shardings)
    embed = ("data", "seq") if fsdp else None
    mixer = placed["layers"][0]["mixer"]
    assert placed["embedding"]["embedding"].sharding.spec == P("tensor", embed)
    assert placed["lm_head"]["kernel"].sharding.spec == P(embed, "tensor")
    assert mixer["in_proj"]["kernel"]["x"].sharding.spec == P(embed, "tensor")
    assert mixer["in_proj"]["kernel"]["dt"].sharding.spec == P(embed, "tensor")
    # One group of B and C (every head reads it): whole on every device.
    assert mixer["in_proj"]["kernel"]["B"].sharding.spec == P(embed, None, None)
    assert mixer["out_proj"]["kernel"].sharding.spec == P("tensor", embed)
    assert mixer["A_log"].sharding.spec == P("tensor")
    assert placed["norm_f"]["weight"].sharding.spec == P(embed)
    # Really split: each device holds half of the x part's output columns.
    x_part = mixer["in_proj"]["kernel"]["x"]
    assert x_part.addressable_shards[0].data.shape == (
        64 // (4 if fsdp else 1),
        x_part.shape[1] // 2,
    )
    # The State form gives the same shardings.
    state_shardings = sharding.param_shardings(
        nnx.state(model, nnx.Param), mesh, sharding.rules(fsdp)
    )
    assert nnx.to_pure_dict(state_shardings) == shardings


# ----------------------------------------------------------------------------- sharded == single


KINDS = {
    "mamba": (("mamba",), ""),
    "mamba2": (("mamba2",), ""),
    "attention": (("attention",), ""),
    "swa": (("swa",), ""),
    "mlp": (("mlp",), ""),
    "infini": (("infini",), ""),
    "mamba2+lsh+ks": (("mamba2",), "lsh+ks"),
    "mamba+lsh+ks": (("mamba",), "lsh+ks"),
}


def _loss_fn(graphdef, abstract, cfg, training):
    """mean CE of the LM logits (+ alpha * ranking losses in training) of pure-dict params."""

    def loss(params, tokens, targets):
        state = jax.tree.map(lambda v: v, abstract)
        nnx.replace_by_pure_dict(state, params)
        model = nnx.merge(graphdef, state)
        rng = jax.random.key(0) if training else None
        logits, sown = nnx.capture(model, nnx.Intermediate)(tokens, rng=rng)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
        return ce + cfg.sparse.rank_loss_weight * rank_loss_sum(sown)

    return jax.jit(jax.value_and_grad(loss), compiler_options=FAST_COMPILE)


def _rel_diff(a, b, floor: float = 0.0) -> float:
    """max |a - b| / max |b|, with max |b| floored at `floor`."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), floor, 1e-30))


@pytest.mark.parametrize("kind", list(KINDS))
def test_sharded_loss_and_grads_equal_single_device(mesh, kind):
    _check_sharded_equals_single_device(mesh, kind, sharding.rules())


@pytest.mark.parametrize("kind", ["mamba", "mamba2+lsh+ks"])
def test_fsdp_loss_and_grads_equal_single_device(mesh, kind):
    """FSDP's rules: every parameter's d_model split over "data" and "seq" as well."""
    _check_sharded_equals_single_device(mesh, kind, sharding.rules(fsdp=True))


def _check_sharded_equals_single_device(mesh, kind, rules):
    """Loss and gradients on the 2 x 2 x 2 mesh, parameters placed by `rules`, against one
    device."""
    pattern, sparse = KINDS[kind]
    cfg = _cfg(pattern, sparse)
    with jax.default_device(CPUS[0]):
        model = LanguageModel(cfg, rngs=nnx.Rngs(1))
        keys = jax.random.split(jax.random.key(2))
        tokens = jax.random.randint(keys[0], (B, L), 0, cfg.vocab_size)
        targets = jax.random.randint(keys[1], (B, L), 0, cfg.vocab_size)
    graphdef, state = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(state)
    loss_and_grad = _loss_fn(graphdef, state, cfg, training=bool(sparse))

    want_loss, want_grads = loss_and_grad(params, tokens, targets)

    data = NamedSharding(mesh, P("data", "seq"))
    sharded_params = jax.device_put(params, sharding.param_shardings_dict(state, mesh, rules))
    with jax.set_mesh(mesh):
        loss, grads = loss_and_grad(
            sharded_params, jax.device_put(tokens, data), jax.device_put(targets, data)
        )
    assert loss.sharding.num_devices == 8
    assert _rel_diff(loss, want_loss) < RTOL
    # Per array, relative to its own scale, or to 1% of the largest gradient for arrays whose
    # exact gradient is zero (the scorer's last bias cancels in the ranking loss's pairwise
    # differences: one device gives 2e-9 of rounding, the sharded run exactly 0).
    floor = 1e-2 * max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(want_grads))
    diffs = jax.tree.map(lambda a, b: _rel_diff(a, b, floor), grads, want_grads)
    worst = max(jax.tree.leaves(diffs))
    assert worst < RTOL, diffs
    # The gradients come back laid out like the parameters (under FSDP's rules the train step's
    # out_shardings lay them out; this bare jit leaves that to GSPMD).
    in_proj = "in_proj" if "mamba" in kind else None
    if in_proj and rules == sharding.rules():
        assert grads["layers"][0]["mixer"][in_proj]["kernel"]["x"].sharding.spec == P(
            None, "tensor"
        )
