"""Data and sequence parallelism add their collectives and no copy of the conv's input.

Under a multi-device mesh the mixers run inside shard_map (hax_jax.parallel.per_device). A zero
conv window passed in from outside is an opaque operand there, so XLA copied [window | x] into a
new (b, l + width - 1, c) array per conv instead of padding x in place as on one device: 3.3 ms of
a 77 ms Mamba-2 130M step on 2 x H100 (BENCHMARKS.md, "Multi-GPU training step"). Under seq = 2
the window is the previous shard's halo, and building [halo | x] cost 6.7 ms of a 97 ms step at
1 x 32768 on 2 x H200. Read from the optimized HLO of the tiny LM's value_and_grad on the
simulated CPU devices of tests/conftest.py.
"""

import re

import jax
import pytest
from jax.sharding import PartitionSpec as P

from hax_jax.config import Mamba2Config, MambaConfig, MeshConfig, ModelConfig
from tests.support.collectives import sharded_step

B, L, D, VOCAB, N, WIDTH = 4, 256, 64, 96, 8, 4
CONCATENATE = re.compile(r"= \w+\[([\d,]*)\]\S* concatenate\(")


def _padded_copies(kind: str, data: int, seq: int) -> list[tuple[int, ...]]:
    """Shapes of the step's concatenates with a shard's l + width - 1 positions (a conv's
    [window | x])."""
    cfg = ModelConfig(
        d_model=D,
        n_layer=1,
        vocab_size=VOCAB,
        block_pattern=(kind,),
        mamba=MambaConfig(d_state=N, d_conv=WIDTH),
        mamba2=Mamba2Config(d_state=N, d_conv=WIDTH, headdim=8, chunk_size=8),
    )
    step, params, tokens, mesh = sharded_step(
        cfg, MeshConfig(data=data, seq=seq, tensor=1), B, L, P("data", "seq")
    )
    with jax.set_mesh(mesh):
        hlo = step.lower(params, tokens).compile().as_text()
    shapes = [tuple(int(d) for d in m.group(1).split(",")) for m in CONCATENATE.finditer(hlo)]
    return [s for s in shapes if len(s) == 3 and s[1] == L // seq + WIDTH - 1]


@pytest.mark.parametrize("data, seq", [(2, 1), (1, 2)], ids=["data2", "seq2"])
@pytest.mark.parametrize("kind", ["mamba2", "mamba"])
def test_no_conv_window_copy(kind, data, seq):
    assert _padded_copies(kind, data, seq) == [], kind
