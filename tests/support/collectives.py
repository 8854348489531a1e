"""The LM training step (loss + gradients) on abstract sharded inputs, and the collectives of its
compiled program, read from optimized HLO."""

import collections
import math
import re

import jax
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hax_jax import sharding
from hax_jax.config import MeshConfig, ModelConfig
from hax_jax.models.lm import LanguageModel, rank_loss_sum

COLLECTIVE = re.compile(
    r"= (\S+|\(.*?\)) (all-gather|all-reduce|collective-permute|reduce-scatter|all-to-all)"
    r"(?:-start)?\("
)
ARRAY = re.compile(r"\w+\[([\d,]*)\]")


def sharded_step(
    cfg: ModelConfig,
    mesh_cfg: MeshConfig,
    batch: int,
    length: int,
    tokens_spec: P,
    rules: sharding.Rules = sharding.RULES,
):
    """(jitted value_and_grad of the LM loss with the ranking loss of a sparse branch, abstract
    params and tokens placed on the simulated CPU devices' mesh, the mesh). The model is given a
    mask of real tokens, as train.py gives it (the ranking loss then draws no padding)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: LanguageModel(cfg, rngs=nnx.Rngs(0))))

    def loss(params, tokens):
        model = nnx.merge(graphdef, params)
        real = tokens >= 0
        logits, sown = nnx.capture(model, nnx.Intermediate)(
            tokens, mask=real, rng=jax.random.key(0)
        )
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()
        return ce + rank_loss_sum(sown)

    mesh = sharding.make_mesh(mesh_cfg, jax.devices("cpu"))
    params = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        state,
        sharding.param_shardings(state, mesh, rules),
    )
    tokens = jax.ShapeDtypeStruct(
        (batch, length), "int32", sharding=NamedSharding(mesh, tokens_spec)
    )
    return jax.jit(jax.value_and_grad(loss)), params, tokens, mesh


def step_collectives(
    cfg: ModelConfig, mesh_cfg: MeshConfig, batch: int, length: int, tokens_spec: P
) -> list[tuple[str, str]]:
    """(kind, result shape) of every collective in the compiled `sharded_step`."""
    step, params, tokens, mesh = sharded_step(cfg, mesh_cfg, batch, length, tokens_spec)
    with jax.set_mesh(mesh):
        hlo = step.lower(params, tokens).compile().as_text()
    return collectives_of(hlo)


def collectives_of(hlo: str) -> list[tuple[str, str]]:
    """(kind, result shape) of every collective in optimized HLO text."""
    return [(m.group(2), m.group(1)) for m in COLLECTIVE.finditer(hlo)]


def arrays(collectives: list[tuple[str, str]]) -> list[tuple[str, tuple[int, ...]]]:
    """(kind, shape) of every array a collective moves (a combined collective moves several)."""
    return [
        (kind, tuple(int(d) for d in m.group(1).split(",") if d))
        for kind, shape in collectives
        for m in ARRAY.finditer(re.sub(r"\{.*?\}", "", shape))
    ]


def elements_by_kind(hlo: str) -> collections.Counter:
    """{kind: elements of all the arrays its collectives move} in optimized HLO text."""
    totals = collections.Counter()
    for kind, shape in arrays(collectives_of(hlo)):
        totals[kind] += math.prod(shape)
    return totals
