"""Tensor parallelism the Mamba-2 way (Mamba-2 paper §8.1): per block, one all-reduce of the
residual stream (b, l, d) in the forward (out_proj) and one in the backward (in_proj's input
gradient); everything between is local to a device's heads and groups.

Counted in the optimized HLO of value_and_grad of a tiny LM under tensor = 2 on the simulated CPU
devices of tests/conftest.py; one block's collectives are the difference between a 2-layer and a
1-layer model, so the embedding's, the loss's and the optimizer's own cancel.
"""

import collections

import pytest
from jax.sharding import PartitionSpec as P

from hax_jax.config import Mamba2Config, MambaConfig, MeshConfig, ModelConfig, SparseConfig
from tests.support.collectives import arrays, step_collectives

B, L, D, VOCAB, N = 2, 256, 64, 96, 8  # no other size of the model equals L or VOCAB
RESIDUAL = (B, L, D)


def _arrays(kind: str, n_layer: int, *, groups: int = 1, sparse: str = ""):
    cfg = ModelConfig(
        d_model=D,
        n_layer=n_layer,
        vocab_size=VOCAB,
        block_pattern=(kind,),
        mamba=MambaConfig(d_state=N),
        mamba2=Mamba2Config(d_state=N, headdim=8, chunk_size=8, ngroups=groups),
        sparse=SparseConfig(pattern=sparse, num_keys=16, hash_bits=3, max_len=L),
    )
    return arrays(step_collectives(cfg, MeshConfig(data=1, seq=1, tensor=2), B, L, P()))


def _per_block(kind: str, **kw) -> collections.Counter:
    """(kind, shape) -> how many arrays one more block adds to the step's collectives."""
    count = collections.Counter(_arrays(kind, 2, **kw))
    count.subtract(_arrays(kind, 1, **kw))
    return collections.Counter({k: v for k, v in count.items() if v})


def _per_position(count: collections.Counter) -> dict:
    """The arrays with an axis of positions (activations), other than the residual stream."""
    return {k: v for k, v in count.items() if L in k[1] and k[1] != RESIDUAL}


@pytest.mark.parametrize(
    "kind, kw, small",
    [
        # Groups split with their heads: nothing else at all.
        ("mamba2", dict(groups=2), {}),
        # One group, read by every head, replicated: its RMSNorm spans both devices' channels
        # (its mean square, forward and backward); B's and C's weights' gradients sum over the
        # devices (parameter-sized, once a step).
        ("mamba2", dict(groups=1), {(B, L, 1): 2}),
        # Mamba-1: x_proj contracts the split d_inner (dt, B, C: R + 2N wide, once), and its
        # backward sums dt's and B's, C's gradients.
        ("mamba", {}, {(B, L, 4 + 2 * N): 1, (B, L, 4): 1, (B, L, N): 2}),
        # HAX: the q/k projection contracts the split d_inner (2N wide), and its backward.
        ("mamba2", dict(groups=2, sparse="lsh+ks"), {(B, L, 2 * N): 1, (B, L, N): 2}),
    ],
    ids=["mamba2-groups-split", "mamba2-one-group", "mamba", "hax-mamba2"],
)
def test_one_all_reduce_of_the_residual_per_block_each_way(kind, kw, small):
    per_block = _per_block(kind, **kw)
    assert per_block[("all-reduce", RESIDUAL)] == 2, per_block
    assert {shape: n for (_, shape), n in _per_position(per_block).items()} == small, per_block
    assert all(k == "all-reduce" for k, _ in per_block), per_block


def test_no_logits_or_resharding_collectives():
    """The vocabulary is split over "tensor" (embedding and logits): the loss reduces (b, l)
    statistics, never gathers (b, l, vocab) logits; no collective reshards an activation."""
    step = _arrays("mamba2", 2, groups=2, sparse="lsh+ks")
    assert not [a for a in step if VOCAB in a[1] and L in a[1]], step
    assert {k for k, _ in step} == {"all-reduce"}, step
