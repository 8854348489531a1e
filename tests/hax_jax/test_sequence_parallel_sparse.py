"""Sequence parallelism of the HAX sparse-attention branch: every pattern, split over "seq",
gives the one-device loss (task + ranking) and every gradient.

Each shard's queries merge the keys the earlier shards leave selectable (per LSH bucket the kc
most recent, the kc best-scored, the last / first / dilated kc: hax_jax.parallel,
pallas_kernels/sparse_attention/carry.py, and carry_pallas.py for the kernels). With 64 tokens,
num_keys 8 and 4 LSH buckets, shards of 8-32 positions put boundaries inside bucket histories, KS
prefixes, windows and sinks.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hax_jax import sharding
from hax_jax.config import MeshConfig
from hax_jax.parallel import top_k_over_sequence
from pallas_kernels.sparse_attention.carry import take_rows
from tests.hax_jax.test_sequence_parallel import MESHES, _cfg, _check_split_equals_one_device
from tests.support.collectives import sharded_step
from tests.support.jaxprs import primitives

PATTERNS = ("sw", "sink", "dilated", "lsh", "ks", "full", "sw+sink", "sw+dilated", "lsh+ks")
MESH_IDS = list(MESHES)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_every_pattern(pattern):
    """Each pattern on a Mamba-2 layer, on one of the meshes in turn."""
    mesh_id = MESH_IDS[PATTERNS.index(pattern) % len(MESH_IDS)]
    _check_split_equals_one_device(_cfg(("mamba2",), pattern), MESHES[mesh_id], False)


# The op per shard: the Pallas kernels (interpreted on CPU) over the earlier shards' carried keys
# put in front of the shard's own (carry_pallas.py), or the pure-JAX path gathering each query's
# keys.
IMPL = {"seq2": "indexed", "seq4": "pallas", "seq8": "indexed", "dst222": "pallas"}


def _with_impl(cfg, impl):
    return dataclasses.replace(cfg, sparse=dataclasses.replace(cfg.sparse, impl=impl))


@pytest.mark.parametrize("mesh_id", MESH_IDS)
def test_hax_on_every_mesh(mesh_id):
    """HAX (lsh+ks) beside Mamba and Mamba-2 layers on every mesh, by either impl."""
    cfg = _with_impl(_cfg(("mamba", "mamba2"), "lsh+ks"), IMPL[mesh_id])
    _check_split_equals_one_device(cfg, MESHES[mesh_id], False)


@pytest.mark.parametrize("pattern", ["lsh", "ks"])
def test_pallas_over_the_carry_per_component(pattern):
    """Each component alone by the Pallas kernels: a bucket's history or a KS prefix cut by a
    shard boundary selects as on one device."""
    cfg = _with_impl(_cfg(("mamba2",), pattern), "pallas")
    _check_split_equals_one_device(cfg, MESHES["seq2"], False)


def test_remat_recomputes_no_selection_on_a_split_sequence():
    """seq = 2, HAX by the Pallas kernels: under remat the backward recomputes each block but none
    of the sparse branch's selection (the published rows, the carried rows, the kernels' layout,
    the ranking loss's candidates: named and saved), so the gradient holds as many sorts and
    top-ks as without remat."""
    base = _with_impl(_cfg(("mamba2",), "lsh+ks"), "pallas")

    def count(remat):
        cfg = dataclasses.replace(base, remat=remat)
        step, params, tokens, mesh = sharded_step(
            cfg, MeshConfig(data=1, seq=2, tensor=1), 2, 64, P(None, "seq")
        )
        with jax.set_mesh(mesh):
            names = list(primitives(step.trace(params, tokens).jaxpr))
        return names.count("sort"), names.count("top_k")

    plain = count("none")
    assert plain[0] > 0 and plain[1] > 0
    assert count("block") == plain


def test_block_keep_scan_on_a_split_sequence():
    """seq = 2, every scan, conv, gated norm (HAX-Mamba-2's taking the branch's output and E in
    its kernels) and the branch by the Pallas kernels, model.remat="block_keep_scan" (the
    backward keeps the mixers' GEMM outputs, the scans' y, the SSD's chunk states and a shard's
    decay): the one-device loss and gradients."""
    cfg = _with_impl(_cfg(("mamba", "mamba2"), "lsh+ks"), "pallas")
    cfg = dataclasses.replace(
        cfg,
        remat="block_keep_scan",
        mamba=dataclasses.replace(cfg.mamba, scan_impl="pallas", conv_impl="pallas"),
        mamba2=dataclasses.replace(
            cfg.mamba2, ssd_impl="pallas", chunk_size=16, conv_impl="pallas", norm_impl="pallas"
        ),
    )
    _check_split_equals_one_device(cfg, MESHES["seq2"], False)


@pytest.mark.parametrize(
    "dtype, shape", [(jnp.float32, (2, 10, 3)), (jnp.bfloat16, (2, 10, 3)), (jnp.float32, (2, 10))]
)
def test_take_rows_gradient_is_the_gathers_transpose(dtype, shape):
    """carry.take_rows (a custom VJP: the gradient gathered by the inverse map) equals
    take_along_axis and its autodiff scatter-add, values and gradient, when the valid rows take
    distinct positions and the placeholders get no cotangent."""
    rng = np.random.default_rng(0)
    at = jnp.array([[3, 0, 7, 0, 5], [9, 1, 0, 2, 0]])
    valid = jnp.array([[1, 0, 1, 0, 1], [1, 1, 0, 1, 0]], bool)
    x = jnp.asarray(rng.standard_normal(shape), dtype)
    mask = valid.reshape(*valid.shape, *([1] * (x.ndim - 2)))
    w = jnp.asarray(rng.standard_normal((2, 5, *shape[2:])), dtype) * mask
    index = at.reshape(*at.shape, *([1] * (x.ndim - 2)))

    def fast(x):
        return jnp.sum((take_rows(x, at, valid) * w).astype(jnp.float32))

    def plain(x):
        return jnp.sum((jnp.take_along_axis(x, index, axis=1) * w).astype(jnp.float32))

    rows = take_rows(x, at, valid)
    want_rows = jnp.take_along_axis(x, index, axis=1)
    np.testing.assert_array_equal(np.asarray(rows, np.float32), np.asarray(want_rows, np.float32))
    grad, want = jax.grad(fast)(x), jax.grad(plain)(x)
    assert grad.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(grad, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("mesh_id", MESH_IDS)
def test_top_k_over_the_sequence_is_one_top_k(mesh_id):
    """parallel.top_k_over_sequence (each shard's top k, then the top k of those) gives
    jax.lax.top_k's values and positions, ties (padding's -1, repeated values) to the lower
    position, with the rows split over "seq" (and "data")."""
    rng = np.random.default_rng(1)
    noise = rng.integers(0, 6, (4, 64)).astype(np.float32)  # many ties
    noise[:, 40:] = -1.0  # padding, as the ranking loss marks it
    noise[3, 5:] = -1.0  # a row with fewer real positions than k
    mesh = sharding.make_mesh(MeshConfig(**dict(zip(("data", "seq", "tensor"), MESHES[mesh_id]))))
    x = jax.device_put(noise, NamedSharding(mesh, P("data", "seq")))
    with jax.set_mesh(mesh):
        values, index = jax.jit(top_k_over_sequence, static_argnums=1)(x, 12)
    want_values, want_index = jax.lax.top_k(jnp.asarray(noise), 12)
    np.testing.assert_array_equal(values, want_values)
    np.testing.assert_array_equal(index, want_index)
