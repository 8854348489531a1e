"""The SSD on a split sequence (hax_jax.parallel.ssd_sequence_parallel) equals the step-by-step
recurrence over the whole sequence (`ssd(impl="sequential")`): values and every gradient, the final
state's included. The Pallas path (`pallas_kernels.ssd.ops.ssd_shard`: each shard's chunk states
once, the zero-start states passed between shards, the kernels from the entering state, the
backward with each shard's final-state gradient from the later shards) runs interpreted on the
simulated CPU devices of tests/conftest.py.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from hax_jax import sharding
from hax_jax.config import MeshConfig
from hax_jax.parallel import CARRIED, ssd_sequence_parallel
from pallas_kernels.ssd import ssd
from pallas_kernels.ssd.ops import ssd_shard
from tests.support.collectives import COLLECTIVE

RTOL = 1e-4  # fp32: max |split - whole| / max |whole|, per array
Bsz, L, H, P_, G, N, CHUNK = 2, 128, 4, 8, 2, 16, 16
CPUS = jax.devices("cpu")


def _inputs(seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 8)
    x = jax.random.normal(keys[0], (Bsz, L, H, P_))
    dt = jax.nn.softplus(jax.random.normal(keys[1], (Bsz, L, H)) - 1.0)
    A = -jnp.exp(jax.random.normal(keys[2], (H,)) * 0.5)
    B = jax.random.normal(keys[3], (Bsz, L, G, N))
    C = jax.random.normal(keys[4], (Bsz, L, G, N))
    D = jax.random.normal(keys[5], (H,))
    h0 = jax.random.normal(keys[6], (Bsz, H, P_, N))
    return (x, dt, A, B, C, D, h0), keys[7]


def _seq_idx(shards: int) -> jnp.ndarray:
    """Row 0: documents changing inside a shard and exactly at the second shard's first
    position; row 1: one document."""
    edge = L // shards
    row = np.zeros(L, np.int32)
    for start in (edge // 2 + 3, edge, edge + 21):
        row[start:] += 1
    return jnp.asarray(np.stack([row, np.zeros(L, np.int32)]))


def _loss_fn(ssd_fn, weights_key, final_weight: float = 1.0):
    """sum(y * w1) + final_weight * sum(final * w2) and y: both outputs' gradients enter (with
    final_weight 0 the final state's gradient is a symbolic zero, as in training)."""
    w1 = jax.random.normal(weights_key, (Bsz, L, H, P_))
    w2 = jax.random.normal(jax.random.fold_in(weights_key, 1), (Bsz, H, P_, N))

    def loss(args, seq_idx):
        y, final = ssd_fn(*args, seq_idx)
        if not final_weight:
            return jnp.sum(y * w1), y
        return jnp.sum(y * w1) + final_weight * jnp.sum(final * w2), y

    return loss


def _whole(x, dt, A, B, C, D, h0, seq_idx):
    return ssd(
        x, dt, A, B, C, chunk_size=CHUNK, D=D, initial_state=h0, seq_idx=seq_idx,
        return_final_state=True, impl="sequential",
    )  # fmt: skip


def _split(mesh, impl):
    """ssd_sequence_parallel shard_map'd over "seq"."""

    def per_shard(x, dt, A, B, C, D, h0, seq_idx):
        return ssd_sequence_parallel(x, dt, A, B, C, D, h0, seq_idx, chunk_size=CHUNK, impl=impl)

    seq = P(None, "seq")
    return jax.shard_map(
        per_shard,
        mesh=mesh,
        in_specs=(seq, seq, P(), seq, seq, P(), P(), seq),
        out_specs=(seq, P()),
        check_vma=False,
    )


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


@pytest.mark.parametrize(
    "impl, shards, documents, final_weight",
    [
        *[(i, s, d, 1.0) for i in ("pallas", "chunked") for s in (2, 4) for d in (False, True)],
        # The final state's gradient a symbolic zero: on two shards the backward's one
        # collective-permute, on four its all-gather.
        *[("pallas", s, True, 0.0) for s in (2, 4)],
    ],
)
def test_split_sequence_equals_the_recurrence(impl, shards, documents, final_weight):
    """The Pallas path (exchange inside the kernels' custom VJP) and the portable one (the
    zero-start state by one matmul, autodiff through the exchange); the final state's gradient
    given, and (Pallas) a symbolic zero."""
    args, key = _inputs()
    seq_idx = _seq_idx(shards) if documents else None
    want_loss = _loss_fn(_whole, key, final_weight)
    (want, want_y), want_grads = jax.value_and_grad(want_loss, has_aux=True)(args, seq_idx)
    mesh = sharding.make_mesh(MeshConfig(data=1, seq=shards, tensor=1), CPUS)
    with jax.set_mesh(mesh):
        split = _split(mesh, impl)
        got_loss = _loss_fn(
            lambda *a: split(*a[:-1], a[-1] if documents else None), key, final_weight
        )
        if documents:
            fn = jax.jit(jax.value_and_grad(got_loss, has_aux=True))
            (got, got_y), got_grads = fn(args, seq_idx)
        else:
            fn = jax.jit(jax.value_and_grad(lambda a: got_loss(a, None), has_aux=True))
            (got, got_y), got_grads = fn(args)
    assert _rel(got_y, want_y) < RTOL
    assert _rel(got, want) < RTOL
    names = ("x", "dt", "A", "B", "C", "D", "initial_state")
    for name, g, w in zip(names, got_grads, want_grads, strict=True):
        assert _rel(g, w) < RTOL, f"d{name}: {_rel(g, w):.2e}"


@pytest.mark.parametrize(
    "exchange, keep_in, message",
    [
        ((len,), jnp.ones(Bsz), "exchange must be a pair of functions"),
        ((len, len), jnp.ones(Bsz + 1), r"keep_in must have shape \(b,\)"),
    ],
)
def test_ssd_shard_refuses_bad_arguments(exchange, keep_in, message):
    (x, dt, A, B, C, D, h0), _ = _inputs()
    with pytest.raises(ValueError, match=message):
        ssd_shard(x, dt, A, B, C, chunk_size=CHUNK, exchange=exchange, keep_in=keep_in, D=D)


@pytest.mark.parametrize("shards", [2, 4])
def test_a_rematerialised_shard_reruns_no_exchange(shards):
    """Under the blocks' remat policy (keep what was received), the Pallas path's recompute
    passes no state again: its gradient has the collectives of the plain one (the exchange
    forward and its transpose)."""
    args, _ = _inputs()
    mesh = sharding.make_mesh(MeshConfig(data=1, seq=shards, tensor=1), CPUS)
    policy = jax.checkpoint_policies.save_only_these_names(CARRIED)

    def collectives(remat: bool) -> collections.Counter:
        with jax.set_mesh(mesh):
            split = _split(mesh, "pallas")
            fn = jax.checkpoint(split, policy=policy) if remat else split
            # value_and_grad: the forward's own outputs are used, so its exchange stays.
            grad = jax.jit(jax.value_and_grad(lambda a: jnp.sum(fn(*a, None)[0])))
            hlo = grad.lower(args).compile().as_text()
        return collections.Counter(kind for _, kind in COLLECTIVE.findall(hlo))

    plain = collectives(False)
    assert sum(plain.values()) >= 2, plain  # the exchange and its transpose
    assert collectives(True) == plain
