"""The sharded training step lowers for TPU (StableHLO, cross-lowered on the CPU: not compiled).

What runs on a TPU by default (impl="auto": the pure-JAX paths, each op per device in shard_map,
states passed between sequence shards) under every mesh axis at once, with FSDP too, for both SSM
mixers with the HAX branch. The Pallas kernels' own TPU lowering is tested in tests/pallas_kernels.
"""

import jax
import pytest
from jax.sharding import PartitionSpec as P

from hax_jax import sharding
from hax_jax.config import Mamba2Config, MambaConfig, MeshConfig, ModelConfig, SparseConfig
from tests.support.collectives import sharded_step


@pytest.mark.parametrize("fsdp", [False, True])
def test_the_sharded_step_lowers_for_tpu(fsdp):
    cfg = ModelConfig(
        d_model=64,
        n_layer=2,
        vocab_size=96,
        block_pattern=("mamba2", "mamba"),
        mamba=MambaConfig(d_state=8),
        mamba2=Mamba2Config(d_state=8, headdim=8, chunk_size=8, ngroups=2),
        sparse=SparseConfig(pattern="lsh+ks", num_keys=16, hash_bits=3, max_len=256),
    )
    mesh_cfg = MeshConfig(data=2, seq=2, tensor=2, fsdp=fsdp)
    step, params, tokens, mesh = sharded_step(
        cfg, mesh_cfg, 4, 256, P("data", "seq"), sharding.rules(fsdp)
    )
    with jax.set_mesh(mesh):
        traced = step.trace(params, tokens)
        text = traced.lower(lowering_platforms=("tpu",)).as_text()
    assert "sdy.manual_computation" in text  # the ops per device (shard_map)
    assert "stablehlo.collective_permute" in text  # the conv halo between sequence shards
    assert "stablehlo.all_reduce" in text
