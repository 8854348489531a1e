"""Sequence parallelism of the HAX sparse-attention branch: every pattern, split over "seq",
gives the one-device loss (task + ranking) and every gradient.

Each shard's queries merge the keys the earlier shards leave selectable (per LSH bucket the kc
most recent, the kc best-scored, the last / first / dilated kc: hax_jax.parallel,
pallas_kernels/sparse_attention/carry.py). With 64 tokens, num_keys 8 and 4 LSH buckets, shards
of 8-32 positions put boundaries inside bucket histories, KS prefixes, windows and sinks.
"""

import pytest

from tests.hax_jax.test_sequence_parallel import MESHES, _cfg, _check_split_equals_one_device

PATTERNS = ("sw", "sink", "dilated", "lsh", "ks", "full", "sw+sink", "sw+dilated", "lsh+ks")
MESH_IDS = list(MESHES)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_every_pattern(pattern):
    """Each pattern on a Mamba-2 layer, on one of the meshes in turn."""
    mesh_id = MESH_IDS[PATTERNS.index(pattern) % len(MESH_IDS)]
    _check_split_equals_one_device(_cfg(("mamba2",), pattern), MESHES[mesh_id], False)


@pytest.mark.parametrize("mesh_id", MESH_IDS)
def test_hax_on_every_mesh(mesh_id):
    """HAX (lsh+ks) beside Mamba and Mamba-2 layers on every mesh."""
    _check_split_equals_one_device(_cfg(("mamba", "mamba2"), "lsh+ks"), MESHES[mesh_id], False)
