"""Sequence parallelism: a split "seq" axis gives the one-device loss and every gradient.

The SSM mixers pass their states between shards (hax_jax.parallel): the shards' (total decay,
state from a zero start) pairs are combined over "seq" and each shard scans from its incoming
state, the conv takes a halo from the previous shard; sliding windows take a halo of keys and
values, full attention all-gathers them, Infini-attention passes its memory. Checked on the 8
simulated CPU devices of tests/conftest.py, with shards of 8 positions (several SSD chunks of 4,
windows and sparse-attention histories crossing shard boundaries, whole Infini segments), and
packed documents whose boundaries fall inside and at the edge of a shard.
"""

import dataclasses
import functools

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

RTOL = 1e-4  # fp32: max |split - one device| / max |one device|, per array
B, L = 2, 64
CPUS = jax.devices("cpu")
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _cfg(pattern: tuple[str, ...], sparse: str = "", infini: str = "linear") -> ModelConfig:
    """A tiny LM: chunks of 4 and windows of 6 so 8-position shards cut them; segments of 8 (an
    Infini-attention shard holds whole segments), so seq = 2 and 4 pass the memory after several."""
    return ModelConfig(
        d_model=32,
        n_layer=len(pattern),
        vocab_size=64,
        block_pattern=pattern,
        mamba=MambaConfig(d_state=4),
        mamba2=Mamba2Config(d_state=8, headdim=8, chunk_size=4),
        sparse=SparseConfig(pattern=sparse, num_keys=8, hash_bits=2, max_len=L),
        attention=AttentionConfig(n_heads=2, window=6),
        infini=InfiniConfig(n_heads=2, segment_len=8, update=infini),
    )


def _seq_idx() -> np.ndarray:
    """Row 0: documents changing inside shards of 8 and exactly at a shard edge (position 16,
    and 32 for seq = 2); row 1: one document."""
    row = np.zeros(L, np.int32)
    for start in (5, 16, 27, 32, 45):
        row[start:] += 1
    return np.stack([row, np.zeros(L, np.int32)])


def _loss_and_grads(cfg: ModelConfig, with_seq_idx: bool):
    """A jitted value_and_grad of the mean CE (+ ranking losses) over pure-dict params."""
    graphdef, abstract = nnx.split(
        nnx.eval_shape(lambda: LanguageModel(cfg, rngs=nnx.Rngs(0))), nnx.Param
    )

    def loss(params, tokens, targets, seq_idx):
        state = jax.tree.map(lambda v: v, abstract)
        nnx.replace_by_pure_dict(state, params)
        model = nnx.merge(graphdef, state)
        logits, sown = nnx.capture(model, nnx.Intermediate)(
            tokens, seq_idx=seq_idx if with_seq_idx else None, rng=jax.random.key(3)
        )
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
        return ce + cfg.sparse.rank_loss_weight * rank_loss_sum(sown)

    return jax.jit(jax.value_and_grad(loss), compiler_options=FAST_COMPILE)


def _rel_diff(a, b, floor: float = 0.0) -> float:
    """max |a - b| / max |b|, with max |b| floored at `floor`."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), floor, 1e-30))


@functools.cache
def _one_device(cfg: ModelConfig, with_seq_idx: bool):
    """Params, inputs, the jitted loss-and-grad and its one-device values: once per model (the
    meshes of a parametrized test share them)."""
    with jax.default_device(CPUS[0]):
        model = LanguageModel(cfg, rngs=nnx.Rngs(1))
        keys = jax.random.split(jax.random.key(2))
        tokens = jax.random.randint(keys[0], (B, L), 0, cfg.vocab_size)
        targets = jax.random.randint(keys[1], (B, L), 0, cfg.vocab_size)
    state = nnx.state(model, nnx.Param)
    params, seq_idx = nnx.to_pure_dict(state), jnp.asarray(_seq_idx())
    loss_and_grad = _loss_and_grads(cfg, with_seq_idx)
    want = loss_and_grad(params, tokens, targets, seq_idx)
    return state, params, (tokens, targets, seq_idx), loss_and_grad, want


def _check_split_equals_one_device(cfg: ModelConfig, mesh_sizes, with_seq_idx: bool):
    """Loss and every gradient under the mesh equal the one-device ones (RTOL per array)."""
    state, params, inputs, loss_and_grad, (want_loss, want_grads) = _one_device(cfg, with_seq_idx)
    data, seq, tensor = mesh_sizes
    mesh = sharding.make_mesh(MeshConfig(data=data, seq=seq, tensor=tensor), CPUS)
    rows = NamedSharding(mesh, P("data", "seq"))
    placed = jax.device_put(params, sharding.param_shardings_dict(state, mesh))
    with jax.set_mesh(mesh):
        args = (jax.device_put(a, rows) for a in inputs)
        loss, grads = loss_and_grad(placed, *args)
    assert _rel_diff(loss, want_loss) < RTOL
    # Per array, relative to its own scale or to 1% of the largest gradient (arrays whose exact
    # gradient is zero, as the scorer's last bias, compare rounding noise).
    floor = 1e-2 * max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(want_grads))
    diffs = jax.tree.map(lambda a, b: _rel_diff(a, b, floor), grads, want_grads)
    assert max(jax.tree.leaves(diffs)) < RTOL, diffs


MESHES = {"seq2": (1, 2, 1), "seq4": (1, 4, 1), "seq8": (1, 8, 1), "dst222": (2, 2, 2)}


@pytest.mark.parametrize("mesh_sizes", list(MESHES.values()), ids=list(MESHES))
def test_ssm_mixers(mesh_sizes):
    """Mamba and Mamba-2 (kernels' pure-JAX twins per shard, states passed), and an MLP."""
    _check_split_equals_one_device(_cfg(("mamba2", "mamba", "mlp")), mesh_sizes, False)


@pytest.mark.parametrize("mesh_sizes", list(MESHES.values()), ids=list(MESHES))
def test_mamba2_packed_documents(mesh_sizes):
    """seq_idx: a boundary inside a shard or at its edge resets the passed state and halo."""
    _check_split_equals_one_device(_cfg(("mamba2", "mlp")), mesh_sizes, True)


@pytest.mark.parametrize(
    "pattern, with_seq_idx, mesh_sizes",
    [(("mamba2", "mamba"), False, MESHES["dst222"]), (("mamba2",), True, MESHES["seq2"])],
    ids=["mamba2+mamba-dst222", "mamba2-documents-seq2"],
)
def test_conv_kernels_per_shard(pattern, with_seq_idx, mesh_sizes):
    """The conv kernels (`conv_impl="pallas"`, interpreted; shards of 32 positions, one of their
    chunks) take the previous shard's halo as their window, with documents starting inside and
    at the edge of a shard, split over "tensor" too."""
    cfg = _cfg(pattern)
    cfg = dataclasses.replace(
        cfg,
        mamba=dataclasses.replace(cfg.mamba, conv_impl="pallas"),
        mamba2=dataclasses.replace(cfg.mamba2, conv_impl="pallas"),
    )
    _check_split_equals_one_device(cfg, mesh_sizes, with_seq_idx)


ATTENTION = {
    "attention+swa+infini": (("attention", "swa", "infini"), "linear"),
    "infini_delta": (("infini",), "delta"),
}


@pytest.mark.parametrize("mesh_sizes", list(MESHES.values()), ids=list(MESHES))
@pytest.mark.parametrize("model", list(ATTENTION))
def test_attention_mixers(model, mesh_sizes):
    """Full attention (K, V all-gathered), sliding windows (a halo of window - 1 keys, values)
    and Infini-attention (the memory passed by its linear or delta rule)."""
    pattern, rule = ATTENTION[model]
    _check_split_equals_one_device(_cfg(pattern, infini=rule), mesh_sizes, False)


@pytest.mark.parametrize(
    "kind, settings, message",
    [
        (
            "swa",
            dict(attention=AttentionConfig(n_heads=2, window=12)),
            "holds 8 positions, fewer than attention.window - 1 = 11",
        ),
        (
            "infini",
            dict(infini=InfiniConfig(n_heads=2, segment_len=16)),
            "holds 8 positions, not a whole number of segments .infini.segment_len=16.",
        ),
    ],
    ids=["swa", "infini"],
)
def test_shards_too_short_for_the_mixer(kind, settings, message):
    """A window's history spanning several shards, or a segment cut by a shard, is an error."""
    cfg = dataclasses.replace(_cfg((kind,)), **settings)
    model = LanguageModel(cfg, rngs=nnx.Rngs(0))
    mesh = sharding.make_mesh(MeshConfig(data=1, seq=8, tensor=1), CPUS)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=message):
        jax.eval_shape(model, jnp.zeros((B, L), jnp.int32))
