"""The collectives a sequence-parallel training step runs over "seq": a handful of small ones per
block, none of them moving a whole sequence (only states, halos and carries travel).

Counted in the optimized HLO of value_and_grad of a tiny Mamba-2 LM under data x seq = 1 x 2 on
the simulated CPU devices of tests/conftest.py, without and with a HAX branch (lsh+ks, ranking
loss included), also with every block rematerialised (model.remat="block"); one block's count is
the difference between a 2-layer and a 1-layer model, so the loss's and the optimizer's own
collectives cancel.
"""

import collections
import functools
import re

import pytest
from jax.sharding import PartitionSpec as P

from hax_jax.config import Mamba2Config, MeshConfig, ModelConfig, SparseConfig
from tests.support.collectives import step_collectives

# Sizes chosen so no parameter or state dimension equals a length or chunk count below.
L, D_CONV, CHUNK, SHARDS, D_MODEL = 1024, 4, 8, 2, 40


def _sparse(pattern: str) -> SparseConfig:
    return SparseConfig(pattern=pattern, num_keys=16, hash_bits=3, max_len=L)


def _step_collectives(n_layer: int, sparse: str, remat: str) -> list[tuple[str, str]]:
    """(kind, result shape) of every collective of the step under data x seq = 1 x 2."""
    cfg = ModelConfig(
        d_model=D_MODEL,
        n_layer=n_layer,
        vocab_size=48,
        block_pattern=("mamba2",),
        mamba2=Mamba2Config(d_state=8, headdim=8, chunk_size=CHUNK, d_conv=D_CONV),
        sparse=_sparse(sparse),
        remat=remat,
    )
    return step_collectives(cfg, MeshConfig(data=1, seq=SHARDS, tensor=1), 1, L, P(None, "seq"))


# Per block (measured), on two shards where whatever passes goes from the first shard to the
# second (and back in the backward) as one collective-permute: Mamba-2's conv halo and the SSD's
# (decay, final state) pair, each with its transpose (4). HAX adds 7: the sums of q and k before
# the shard (LSH centring), the key scorer's prefix sums, two of the summaries (positions beside
# buckets and scores, keys beside values), the keys' and values' transpose, one small all-reduce
# (two (b, n), one (b, n, h)), and one small all-gather: the ranking loss's candidates, each
# shard's top kc of its own noise as (b, shards x kc), whose top kc is the row's. (On more shards
# the pairs and summaries are all-gathered.)
MOST_PER_BLOCK = {"": 4, "lsh+ks": 11}


@functools.cache
def _per_block(sparse: str, remat: str) -> dict[str, list[tuple[str, str]]]:
    """{1: the 1-layer step's collectives, 2: the 2-layer step's}."""
    return {n: _step_collectives(n, sparse, remat) for n in (1, 2)}


@pytest.fixture(scope="module", params=list(MOST_PER_BLOCK))
def collectives(request):
    return request.param, _per_block(request.param, "none")


def test_a_handful_of_collectives_per_block(collectives):
    """One block adds a handful of collectives over "seq", listed above."""
    sparse, by_layers = collectives
    per_block = collections.Counter(k for k, _ in by_layers[2])
    per_block.subtract(k for k, _ in by_layers[1])
    per_block = {k: v for k, v in per_block.items() if v}
    assert sum(per_block.values()) <= MOST_PER_BLOCK[sparse], per_block
    assert per_block.get("collective-permute", 0) >= 2, per_block  # the conv halo, the states
    # Nothing else that the first shard waits for: the candidates are drawn from the step's rng and
    # the mask alone, before any block runs.
    gathers = [shape for kind, shape in by_layers[2] if kind == "all-gather"]
    candidates = SHARDS * _sparse(sparse).spec.keys_per_component if sparse else 0
    assert all(re.fullmatch(rf"f32\[1,{candidates}\]\S*", g) for g in gathers), gathers


def test_no_collective_moves_a_sequence(collectives):
    """No collective's result has an axis of positions or chunks (of the sequence or a shard):
    activations and chunk states stay on their shard (collective-permutes carry the first
    shard's states, sums and summaries to the second, and the conv's d_conv - 1 = 3 halo
    positions). (GSPMD partitioning the chunked SSD instead all-gathers every chunk's state.)"""
    lengths = {L, L // SHARDS, L // CHUNK, L // (SHARDS * CHUNK)}
    for kind, shape in collectives[1][2]:
        dims = [int(d) for d in re.findall(r"\d+", re.sub(r"\{.*?\}", "", shape))]
        assert not lengths & set(dims), (kind, shape)


def test_the_conv_window_leaves_before_in_proj(collectives):
    """The conv's window crosses as the block input's last d_conv - 1 rows (d_model wide), which
    exist before in_proj, so its collective-permute need not wait for the GEMM; not as in_proj's
    output rows (d_inner + 2 G N wide), which would."""
    window = sorted(
        shape
        for kind, shape in collectives[1][2]
        if kind == "collective-permute" and re.search(rf"\[1,{D_CONV - 1},\d+\]", shape)
    )
    assert window, collectives[1][2]
    widths = {int(re.search(r"\[1,\d+,(\d+)\]", shape)[1]) for shape in window}
    assert widths == {D_MODEL}, window


@pytest.mark.parametrize("sparse", list(MOST_PER_BLOCK))
def test_the_recompute_runs_no_collective(sparse):
    """With every block rematerialised the forward's collectives (halos, passed states, carried
    keys: all-gathers and collective-permutes; the ranking loss's gathers and sums: all-reduces)
    run once, not again in the backward's recompute: the block keeps what it received
    (hax_jax.parallel.CARRIED)."""

    # Whole 2-layer steps: the loss's and the optimizer's collectives are the same in both.
    plain = collections.Counter(k for k, _ in _per_block(sparse, "none")[2])
    remat = collections.Counter(k for k, _ in _step_collectives(2, sparse, "block"))
    for kind in ("all-gather", "collective-permute", "all-reduce"):
        assert remat[kind] == plain[kind], (kind, remat, plain)
