"""Pallas kernels under a multi-device mesh run per device in shard_map: same values and gradients
as on one device (tests/hax_jax/test_sequence_parallel.py covers a split sequence axis).

The kernels run in Pallas interpret mode on the 8 simulated CPU devices of tests/conftest.py;
impl="auto" is checked on traces with `jax.default_backend` patched to "gpu" (nothing compiled).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from hax_jax import sharding
from hax_jax.config import Mamba2Config, MambaConfig, MeshConfig, ModelConfig, SparseConfig
from hax_jax.models.blocks import MIXERS
from hax_jax.parallel import ssd_head_and_group_names
from tests.support.mixer_testing import perturbed, random_inputs

RTOL = 1e-5  # fp32: max |sharded - single| / max |single|, per array
CPUS = jax.devices("cpu")


def _config(kind: str, *, ngroups: int = 1, impl: str = "pallas", hax: bool = True):
    """A small Mamba or Mamba-2 mixer's config, with the HAX sparse-attention branch when `hax`,
    every op on `impl` (the Pallas kernels are interpreted on CPU)."""
    return ModelConfig(
        d_model=32,
        n_layer=1,
        vocab_size=40,
        block_pattern=(kind,),
        mamba=MambaConfig(d_state=8, scan_impl=impl, conv_impl=impl),
        mamba2=Mamba2Config(
            d_state=16,
            headdim=16,
            chunk_size=16,
            ngroups=ngroups,
            ssd_impl=impl,
            conv_impl=impl,
            norm_impl=impl,
        ),
        sparse=SparseConfig(pattern="lsh+ks" if hax else "", num_keys=8, hash_bits=3, impl=impl),
    )


def _loss_and_grads(mixer, u):
    """(y, d loss / d params, d loss / d u) of a fixed random projection of the mixer's output."""
    weights = jax.random.normal(jax.random.key(1), u.shape)

    def loss(mixer, u):
        y, _ = mixer(u)
        return jnp.sum(y * weights), y

    (_, y), (d_params, d_u) = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        mixer, u
    )
    return y, d_params, d_u


def _jaxpr(mixer, u) -> str:
    """The mixer's forward as jaxpr text (under the current mesh)."""
    graphdef, state = nnx.split(mixer)
    return str(jax.make_jaxpr(lambda state, u: nnx.merge(graphdef, state)(u)[0])(state, u))


def _assert_close(actual, desired, what):
    """Every leaf of `actual` within RTOL of the same leaf of `desired`, relative to its scale."""
    for path, a, d in zip(
        jax.tree_util.tree_leaves_with_path(actual),
        jax.tree.leaves(actual),
        jax.tree.leaves(desired),
    ):
        a, d = np.asarray(a), np.asarray(d)
        err = np.max(np.abs(a - d)) / max(np.max(np.abs(d)), 1e-12)
        assert err <= RTOL, f"{what} {jax.tree_util.keystr(path[0])}: relative error {err:.2e}"


@pytest.mark.parametrize(
    "kind, ngroups, batch, hax",
    [("mamba2", 1, 2, True), ("mamba2", 2, 1, False), ("mamba", 1, 2, False)],
)
def test_sharded_kernels_match_one_device(kind, ngroups, batch, hax):
    """data = 2 x tensor = 2, values and every gradient as on one device: batch rows split (a
    batch of 1 stays whole on every device), Mamba-2's 4 heads split with B and C of one group
    replicated or two groups split with their heads, Mamba's 64 channels split (the conv
    kernels reading each device's channels in place), and HAX's sparse attention split by batch
    rows and its 64 value channels (its own shard_map)."""
    cfg = _config(kind, ngroups=ngroups, hax=hax)
    mixer = perturbed(MIXERS[kind](cfg, rngs=nnx.Rngs(0)), seed=7, scale=0.2)
    u = random_inputs(b=batch, l=32, d=32)
    y_ref, dp_ref, du_ref = _loss_and_grads(mixer, u)
    mesh = sharding.make_mesh(MeshConfig(data=2, seq=1, tensor=2), CPUS)
    with jax.set_mesh(mesh):
        y, dp, du = _loss_and_grads(mixer, u)
        jaxpr = _jaxpr(mixer, u)
    assert jaxpr.count("shard_map") >= 1 + hax, "the kernels did not run inside shard_map"
    assert "pallas_call" in jaxpr
    assert "causal_conv1d_fwd" in jaxpr, "the conv kernels did not run"
    _assert_close(y, y_ref, "y")
    _assert_close(du, du_ref, "du")
    _assert_close(nnx.to_pure_dict(dp), nnx.to_pure_dict(dp_ref), "grad")


@pytest.mark.parametrize(
    "heads, groups, tensor, expected",
    [
        (8, 1, 2, ("heads", None)),  # one group: replicated, every head reads it
        (8, 4, 2, ("heads", "heads")),  # groups split with their heads
        (12, 3, 2, (None, None)),  # 6 heads per device would straddle groups of 4
        (6, 1, 4, (None, None)),  # heads not divisible by the tensor size
        (8, 2, 1, (None, None)),  # no tensor axis
    ],
)
def test_ssd_head_and_group_names(heads, groups, tensor, expected):
    mesh = sharding.make_mesh(MeshConfig(data=1, seq=1, tensor=tensor), CPUS)
    with jax.set_mesh(mesh):
        assert ssd_head_and_group_names(heads, groups) == expected


@pytest.fixture
def traced_on(monkeypatch):
    """Makes impl="auto" decide as on the named backend (for tracing only); jit caches are
    cleared before and after, so no trace made for the other backend is reused."""

    def use(platform: str):
        jax.clear_caches()
        monkeypatch.setattr(jax, "default_backend", lambda: platform)

    yield use
    jax.clear_caches()


@pytest.mark.parametrize("kind", ["mamba2", "mamba"])
@pytest.mark.parametrize(
    "platform, mesh, kernels, mapped",
    [
        ("cpu", (2, 1, 2), False, True),  # off-GPU: the pure-JAX paths, per device too
        ("gpu", None, True, False),  # no mesh: the kernels as they are
        ("gpu", (2, 1, 2), True, True),  # data x tensor: the kernels per device
        ("gpu", (2, 2, 2), True, True),  # a split sequence too: kernels per shard, states passed
    ],
)
def test_auto_runs_the_kernels_per_device(traced_on, kind, platform, mesh, kernels, mapped):
    """impl="auto" (a HAX mixer, abstract: traced only): shard_map around the kernels on a GPU
    under a data x tensor mesh, and with a "seq" axis of 2 too (each shard runs the kernels and
    the shards pass their states, hax_jax.parallel)."""
    mixer = nnx.eval_shape(lambda: MIXERS[kind](_config(kind, impl="auto"), rngs=nnx.Rngs(0)))
    u = jax.ShapeDtypeStruct((2, 32, 32), jnp.float32)
    traced_on(platform)
    if mesh is None:
        jaxpr = _jaxpr(mixer, u)
    else:
        data, seq, tensor = mesh
        with jax.set_mesh(sharding.make_mesh(MeshConfig(data=data, seq=seq, tensor=tensor), CPUS)):
            jaxpr = _jaxpr(mixer, u)
    assert ("pallas_call" in jaxpr) == kernels
    assert ("shard_map" in jaxpr) == mapped


@pytest.mark.gpu
@pytest.mark.parametrize("mesh_sizes", [(1, 1, 2), (1, 2, 1)], ids=["tensor2", "seq2"])
@pytest.mark.parametrize("kind", ["mamba2", "mamba"])
def test_auto_runs_the_compiled_kernels_per_gpu(kind, mesh_sizes):
    """On 2 GPUs, impl="auto" (the compiled Triton kernels) inside shard_map over tensor = 2, or
    over seq = 2 with the states passed between the shards, gives the one-GPU values and
    gradients."""
    gpus = jax.devices("gpu")
    if len(gpus) < 2:
        pytest.skip("needs 2 GPUs")
    cfg = ModelConfig(
        d_model=64,
        n_layer=1,
        vocab_size=40,
        block_pattern=(kind,),
        mamba=MambaConfig(d_state=16),
        mamba2=Mamba2Config(d_state=64, headdim=32, chunk_size=64),
        sparse=SparseConfig(pattern="lsh+ks", num_keys=16, hash_bits=3),
    )
    mixer = perturbed(MIXERS[kind](cfg, rngs=nnx.Rngs(0)), seed=7, scale=0.2)
    u = random_inputs(b=2, l=256, d=64)
    y_ref, dp_ref, du_ref = _loss_and_grads(mixer, u)
    data, seq, tensor = mesh_sizes
    mesh = sharding.make_mesh(MeshConfig(data=data, seq=seq, tensor=tensor), gpus[:2])
    replicated = NamedSharding(mesh, PartitionSpec())
    graphdef, state = nnx.split(mixer)
    mixer = nnx.merge(graphdef, jax.device_put(state, replicated))
    u = jax.device_put(u, replicated)
    with jax.set_mesh(mesh):
        y, dp, du = _loss_and_grads(mixer, u)
        assert "shard_map" in _jaxpr(mixer, u)
    _assert_close(y, y_ref, "y")
    _assert_close(du, du_ref, "du")
    _assert_close(nnx.to_pure_dict(dp), nnx.to_pure_dict(dp_ref), "grad")
