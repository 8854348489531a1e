"""The sharded training step lowers for TPU (StableHLO, cross-lowered on the CPU: not compiled).

What runs on a TPU by default (impl="auto": the pure-JAX paths, each op per device in shard_map,
states passed between sequence shards) under every mesh axis at once, with FSDP too, for both SSM
mixers with the HAX branch. The Pallas kernels' own TPU lowering is tested in tests/pallas_kernels.
"""

import jax
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hax_jax import sharding
from hax_jax.config import Mamba2Config, MambaConfig, MeshConfig, ModelConfig, SparseConfig
from hax_jax.models.lm import LanguageModel, rank_loss_sum


@pytest.mark.parametrize("fsdp", [False, True])
def test_the_sharded_step_lowers_for_tpu(fsdp):
    cfg = ModelConfig(
        d_model=64, n_layer=2, vocab_size=96, block_pattern=("mamba2", "mamba"),
        mamba=MambaConfig(d_state=8), mamba2=Mamba2Config(d_state=8, headdim=8, chunk_size=8,
                                                          ngroups=2),
        sparse=SparseConfig(pattern="lsh+ks", num_keys=16, hash_bits=3, max_len=256),
    )  # fmt: skip
    graphdef, state = nnx.split(nnx.eval_shape(lambda: LanguageModel(cfg, rngs=nnx.Rngs(0))))

    def loss(params, tokens):
        model = nnx.merge(graphdef, params)
        logits, sown = nnx.capture(model, nnx.Intermediate)(tokens, rng=jax.random.key(0))
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()
        return ce + rank_loss_sum(sown)

    mesh = sharding.make_mesh(MeshConfig(data=2, seq=2, tensor=2, fsdp=fsdp), jax.devices("cpu"))
    shardings = sharding.param_shardings(state, mesh, sharding.rules(fsdp))
    params = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), state, shardings
    )
    tokens = jax.ShapeDtypeStruct((4, 256), "int32", sharding=NamedSharding(mesh, P("data", "seq")))
    with jax.set_mesh(mesh):
        traced = jax.jit(jax.value_and_grad(loss)).trace(params, tokens)
        text = traced.lower(lowering_platforms=("tpu",)).as_text()
    assert "sdy.manual_computation" in text  # the ops per device (shard_map)
    assert "stablehlo.collective_permute" in text  # the conv halo between sequence shards
    assert "stablehlo.all_reduce" in text
