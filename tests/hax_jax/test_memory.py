"""Memory for long rows: per-block remat (models/lm.py) and the chunked cross-entropy (loss.py).

Each must leave the numbers as they were: loss, metrics and every gradient equal the plain path's.
"""

import contextlib
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxprs import live, primitives, sub_jaxprs

import hax_jax.layers.mamba
import hax_jax.loss
import hax_jax.model_config
from hax_jax import checkpoint, sharding, training
from hax_jax import config as config_lib
from hax_jax.config import (
    SCAN_STATES_SHARE,
    Config,
    Mamba2Config,
    MambaConfig,
    MeshConfig,
    ModelConfig,
    SparseConfig,
)
from hax_jax.models.lm import LanguageModel
from pallas_kernels.selective_scan import saved_states_bytes

# fp32: |a - b| <= ATOL + RTOL |b| for every loss, metric and gradient element. Remat recomputes the
# same ops; chunking only reorders the head gradient's sum over positions.
RTOL, ATOL = 1e-5, 1e-6
# fp32, sharded vs one device: max |a - b| <= ATOL + SHARDED_RTOL max |b| per array. The mesh splits
# sums over d_inner and the vocab, so a single small element can move by more than ATOL + RTOL |b|
# (1.5e-6 on 1e-3 seen on a GPU host's CPUs); its array's scale bounds it.
SHARDED_RTOL = 1e-5
B, L = 2, 32
ALPHA = 0.1  # rank_loss_weight
# mamba2 with the HAX branch: given an rng it sows the ranking loss inside every (remat) block.
CFG = ModelConfig(
    d_model=32,
    n_layer=2,
    vocab_size=61,  # padded to 64: the head has 3 rows no label uses
    block_pattern=("mamba2",),
    mamba2=Mamba2Config(d_state=8, headdim=8, chunk_size=8),
    sparse=SparseConfig(pattern="lsh+ks", num_keys=8, hash_bits=3, max_len=L),
    remat="none",
    loss_chunk=L,  # whole rows
)
CPUS = jax.devices("cpu")


def _batch(b: int = B, l: int = L, vocab: int = CFG.vocab_size) -> dict:
    """A training/eval batch with a ragged loss_mask, one padding row (weight 0) for eval."""
    keys = jax.random.split(jax.random.key(1), 3)
    return {
        "inputs": jax.random.randint(keys[0], (b, l), 0, vocab),
        "labels": jax.random.randint(keys[1], (b, l), 0, vocab),
        "loss_mask": jax.random.bernoulli(keys[2], 0.7, (b, l)),
        "real": jnp.ones((b, l), bool),
        "weight": jnp.ones((b,)).at[-1].set(0.0),
    }


def _params(cfg: ModelConfig):
    """(graphdef, pure-dict params) of a fixed init."""
    graphdef, state = nnx.split(LanguageModel(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    return graphdef, nnx.to_pure_dict(state)


def _loss_grads_eval(cfg: ModelConfig, batch: dict, params=None, mesh=None):
    """(loss, metrics, grads, eval sums) of training.loss_fn and eval_step, jitted, under `mesh`."""
    graphdef, own = _params(cfg)
    params = own if params is None else params
    grad_fn = jax.value_and_grad(training.loss_fn, has_aux=True)
    step = jax.jit(lambda p, b: grad_fn(p, graphdef, b, jax.random.key(5), ALPHA))
    evaluate = jax.jit(lambda p, b: training.eval_step(p, b, graphdef=graphdef))
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        (loss, metrics), grads = step(params, batch)
        sums = evaluate(params, batch)
    return loss, metrics, grads, sums


def _assert_same(got, want):
    """Every leaf of two result trees within RTOL / ATOL."""
    jax.tree.map(
        lambda g, w: np.testing.assert_allclose(np.asarray(g), np.asarray(w), RTOL, ATOL), got, want
    )


def _assert_same_scale(got, want):
    """Every leaf of two result trees within ATOL + SHARDED_RTOL of the leaf's largest magnitude."""

    def check(g, w):
        """One leaf."""
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert np.max(np.abs(g - w)) <= ATOL + SHARDED_RTOL * np.max(np.abs(w))

    jax.tree.map(check, got, want)


def _avals(jaxpr):
    """Every variable's aval in a jaxpr and in all the jaxprs inside it (scan, remat, pjit, ...)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    yield from (v.aval for v in jaxpr.invars)
    for eqn in jaxpr.eqns:
        yield from (v.aval for v in eqn.outvars)
        for sub in sub_jaxprs(eqn):
            yield from _avals(sub)


# The name jax gives jax.checkpoint's primitive in this version ("remat2" in jax 0.10).
REMAT = jax.make_jaxpr(jax.checkpoint(jnp.sin))(1.0).eqns[0].primitive.name


def _grad_jaxpr(cfg: ModelConfig, batch: dict):
    """The jaxpr of training.loss_fn's gradient."""
    graphdef, params = _params(cfg)
    grad = jax.grad(training.loss_fn, has_aux=True)
    return jax.make_jaxpr(lambda p: grad(p, graphdef, batch, jax.random.key(5), ALPHA))(params)


@pytest.fixture(scope="module")
def plain():
    """_loss_grads_eval of CFG (no remat, whole rows) on _batch(): the numbers every remat and
    chunking variant must equal, compiled once for the module."""
    return _loss_grads_eval(CFG, _batch())


# ----------------------------------------------------------------------------- remat


@pytest.mark.parametrize("remat", ["block", "block_keep_scan"])
def test_remat_gives_the_same_loss_metrics_and_gradients(plain, remat):
    assert float(plain[1]["rank_loss"]) > 0  # the branch did sow through the blocks
    _assert_same(_loss_grads_eval(dataclasses.replace(CFG, remat=remat), _batch()), plain)


# A Mamba-1 and a Mamba-2 block on the Pallas scans (interpreted on CPU), HAX branches on both.
KERNELS = dataclasses.replace(
    CFG,
    block_pattern=("mamba", "mamba2"),
    mamba=MambaConfig(d_state=8, scan_impl="pallas"),
    mamba2=dataclasses.replace(CFG.mamba2, ssd_impl="pallas", chunk_size=16),
)


def test_block_keep_scan_reruns_no_ssd_forward_and_changes_no_number():
    """remat="block_keep_scan" saves the mixers' GEMM outputs, the scans' y and the SSD's chunk
    states: the gradient (dead code dropped, as XLA drops it) runs as many Pallas kernels as
    without remat but the Mamba-1 scan's forward again (its states are not kept), where "block"
    also runs the SSD's forward kernels again; loss, metrics and gradients equal remat="none"'s."""
    batch = _batch()

    def kernels(remat):
        """Pallas kernels in the live gradient."""
        grad = _grad_jaxpr(dataclasses.replace(KERNELS, remat=remat), batch)
        return list(primitives(live(grad))).count("pallas_call")

    none, keep_scan, block = kernels("none"), kernels("block_keep_scan"), kernels("block")
    assert keep_scan == none + 1 < block  # the selective scan's forward kernel once more
    plain = _loss_grads_eval(KERNELS, batch)
    _assert_same(
        _loss_grads_eval(dataclasses.replace(KERNELS, remat="block_keep_scan"), batch), plain
    )


def test_remat_is_in_the_gradient_only_when_on(monkeypatch):
    batch = _batch()

    def count(cfg):
        """Remat regions in the gradient's jaxpr."""
        return list(primitives(_grad_jaxpr(cfg, batch))).count(REMAT)

    assert count(CFG) == 0
    assert count(dataclasses.replace(CFG, remat="block")) >= CFG.n_layer
    auto = dataclasses.replace(CFG, remat="auto")
    assert count(auto) == 0  # L = 32 < REMAT_MIN_LEN
    monkeypatch.setattr(hax_jax.model_config, "REMAT_MIN_LEN", L)
    assert count(auto) >= CFG.n_layer


def test_remat_keeps_the_sparse_selection():
    """Under remat a block's backward recomputes its forward but not the sparse branch's
    selection (saved by name: the Pallas layout's sorts and top-ks, the ranking loss's sampled
    candidates): the rematerialised gradient holds as many sorts and top-ks as the plain one."""
    pallas = dataclasses.replace(CFG, sparse=dataclasses.replace(CFG.sparse, impl="pallas"))
    batch = _batch()

    def count(cfg):
        """Sorts and top-ks in the gradient's jaxpr."""
        names = list(primitives(_grad_jaxpr(cfg, batch)))
        return names.count("sort"), names.count("top_k")

    plain = count(pallas)
    assert plain[0] > 0 and plain[1] > 0
    assert count(dataclasses.replace(pallas, remat="block")) == plain


def test_remat_forward_returns_the_same_logits_and_caches():
    tokens = _batch()["inputs"]
    outs = []
    for remat in ("none", "block", "block_keep_scan"):
        model = LanguageModel(dataclasses.replace(CFG, remat=remat), rngs=nnx.Rngs(0))
        outs.append(model.forward(tokens, cache=model.init_cache(B, 2 * L), rng=jax.random.key(3)))
    _assert_same(outs[1], outs[0])
    _assert_same(outs[2], outs[0])


def test_a_run_resumes_across_memory_settings():
    saved = config_lib.to_dict(Config(model=CFG))
    for key in ("remat", "loss_chunk"):  # a checkpoint from before these settings existed
        del saved["model"][key]
    del saved["model"]["mamba"]["scan_states"]
    checkpoint.check_resumable(saved, Config(model=dataclasses.replace(CFG, remat="block")), "w")
    recomputed = dataclasses.replace(CFG, mamba=MambaConfig(scan_states="recomputed"))
    checkpoint.check_resumable(saved, Config(model=recomputed), "w")
    with pytest.raises(ValueError, match="model.d_model: checkpoint 32 vs now 64"):
        checkpoint.check_resumable(saved, Config(model=dataclasses.replace(CFG, d_model=64)), "w")


# ------------------------------------------------------------- Mamba-1 scan states in the backward

# One Mamba-1 layer on the Pallas selective scan (interpreted on CPU).
MAMBA = dataclasses.replace(
    CFG,
    n_layer=1,
    block_pattern=("mamba",),
    mamba=MambaConfig(d_state=8, scan_impl="pallas"),
    sparse=SparseConfig(),
)


def _mamba(scan_states: str, remat: str = "none") -> ModelConfig:
    """MAMBA with mamba.scan_states and remat set."""
    mamba = dataclasses.replace(MAMBA.mamba, scan_states=scan_states)
    return dataclasses.replace(MAMBA, mamba=mamba, remat=remat)


def test_recomputed_scan_states_give_the_same_loss_and_gradients():
    """scan_states="recomputed" runs the scan's forward kernel once more per layer in the
    backward (3 kernels a layer in the gradient, not 2) and changes no number."""
    batch = _batch()

    def kernels(cfg):
        """Pallas kernels in the gradient's jaxpr."""
        return list(primitives(_grad_jaxpr(cfg, batch))).count("pallas_call")

    assert kernels(_mamba("saved")) == 2 * MAMBA.n_layer
    assert kernels(_mamba("recomputed")) == 3 * MAMBA.n_layer
    saved = _loss_grads_eval(_mamba("saved"), batch)
    jax.tree.map(
        np.testing.assert_array_equal, _loss_grads_eval(_mamba("recomputed"), batch), saved
    )


@pytest.mark.parametrize(
    "remat, memory, recompute",
    [
        ("none", None, False),  # CPU: the device tells no memory
        ("none", "small", True),
        ("none", "large", False),
        ("block", "small", False),  # one block's states at a time: nothing held across layers
    ],
)
def test_auto_recomputes_scan_states_past_a_share_of_the_memory(
    monkeypatch, remat, memory, recompute
):
    """ "auto" recomputes when every Mamba layer's saved states (b l d_inner d_state fp32 every
    chunk_bwd steps, per layer) would pass SCAN_STATES_SHARE of the device's memory."""
    d_inner = MAMBA.mamba.expand * MAMBA.d_model
    held = MAMBA.n_layer * saved_states_bytes(B, L, d_inner, MAMBA.mamba.d_state)
    limit = {None: None, "small": held / SCAN_STATES_SHARE - 1, "large": held / SCAN_STATES_SHARE}
    monkeypatch.setattr(hax_jax.layers.mamba, "device_memory_bytes", lambda: limit[memory])
    monkeypatch.setattr(hax_jax.model_config, "REMAT_MIN_LEN", L)
    kernels = list(primitives(_grad_jaxpr(_mamba("auto", remat), _batch())))
    if remat == "none":
        assert kernels.count("pallas_call") == (3 if recompute else 2) * MAMBA.n_layer
    else:  # each block's forward runs again in the backward, its states saved then
        block = list(primitives(_grad_jaxpr(_mamba("saved", remat), _batch())))
        assert kernels.count("pallas_call") == block.count("pallas_call")


# ----------------------------------------------------------------------------- chunked loss


@pytest.mark.parametrize("loss_chunk", [8, 6])  # 4 chunks of 8; 6 chunks of 6 = 32 + 4 padding
def test_chunked_loss_equals_whole_rows(plain, loss_chunk):
    _assert_same(_loss_grads_eval(dataclasses.replace(CFG, loss_chunk=loss_chunk), _batch()), plain)


def test_whole_rows_keep_the_logits_over_the_padded_vocab(plain):
    # The numbers of the code before chunking: optax over model(...)'s padded_vocab_size logits.
    batch = _batch()
    _, metrics, _, sums = plain
    model = LanguageModel(CFG, rngs=nnx.Rngs(0))
    logits, _ = nnx.capture(model, nnx.Intermediate)(
        batch["inputs"], mask=batch["real"], rng=jax.random.key(5)
    )
    assert logits.shape[-1] == CFG.padded_vocab_size > CFG.vocab_size
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
    mask = batch["loss_mask"].astype(jnp.float32)
    hits = (jnp.argmax(logits, -1) == batch["labels"]) * mask * batch["weight"][:, None]
    _assert_same(metrics["task_loss"], jnp.sum(nll * mask) / mask.sum())
    _assert_same(sums["hits"], hits.sum())


@pytest.mark.parametrize("loss_chunk", [L, 8])
def test_loss_gradients_equal_autodiff_of_the_logits(plain, loss_chunk):
    """training.loss_fn (its NLL by loss.weighted_nll, the head's gradient taken in the forward)
    against its twin: autodiff of optax over model(...)'s whole-row logits, the ranking losses
    added."""
    batch = _batch()
    graphdef, params = _params(CFG)
    mask = batch["loss_mask"].astype(jnp.float32)

    def twin(params):
        logits, sown = nnx.capture(nnx.merge(graphdef, params), nnx.Intermediate)(
            batch["inputs"], mask=batch["real"], rng=jax.random.key(5)
        )
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
        return jnp.sum(nll * mask) / mask.sum() + ALPHA * training.rank_loss_sum(sown)

    want = jax.jit(jax.value_and_grad(twin))(params)
    loss, _, grads, _ = (
        plain
        if loss_chunk == L
        else _loss_grads_eval(dataclasses.replace(CFG, loss_chunk=8), batch)
    )
    _assert_same((loss, grads), want)


def test_chunk_count(monkeypatch):
    assert hax_jax.loss.chunk_count((2, 32, 64), 0) == 1  # auto, far under the budget
    assert [hax_jax.loss.chunk_count((2, 32, 64), c) for c in (32, 40, 8, 6, 1)] == [1, 1, 4, 6, 32]
    monkeypatch.setattr(
        hax_jax.loss, "LOGITS_BUDGET", 4 * 2 * 32 * 64 // 5
    )  # a fifth of the logits
    assert hax_jax.loss.chunk_count((2, 32, 64), 0) == 8  # the next power of two
    monkeypatch.setattr(hax_jax.loss, "LOGITS_BUDGET", 1)
    assert hax_jax.loss.chunk_count((2, 3, 64), 0) == 3  # never more chunks than positions
    monkeypatch.setattr(hax_jax.loss, "LOGITS_BUDGET", 4 * 2 * 32 * 64 // 5)
    mesh = sharding.make_mesh(MeshConfig(data=2, seq=2, tensor=2), CPUS)
    with jax.set_mesh(mesh):  # per (data, tensor) shard a quarter: seq shards split each chunk
        assert hax_jax.loss.chunk_count((2, 32, 64), 0) == 2
        assert hax_jax.loss.chunk_count((2, 32, 63), 0) == 4  # an odd vocab stays whole
    with jax.set_mesh(sharding.make_mesh(MeshConfig(data=1, seq=2, tensor=1), CPUS)):
        assert hax_jax.loss.chunk_count((2, 32, 64), 0) == 8  # one device's chunks


def test_chunked_loss_never_holds_tokens_by_vocab_logits():
    # A vocab large enough that the head's arrays stand out from the block's.
    cfg = dataclasses.replace(CFG, vocab_size=4096, sparse=SparseConfig(), n_layer=1)
    chunked = dataclasses.replace(cfg, loss_chunk=4)  # 8 chunks of 4 positions a row
    batch = _batch(vocab=cfg.vocab_size)
    full = B * L * cfg.padded_vocab_size

    def vocab_shapes(cfg):
        """The shapes of the arrays with a vocab axis in the gradient's jaxpr."""
        avals = _avals(_grad_jaxpr(cfg, batch))
        return {a.shape for a in avals if cfg.padded_vocab_size in a.shape[-1:]}

    def largest(shapes):
        """Elements of the largest shape."""
        return max(math.prod(s) for s in shapes)

    assert largest(vocab_shapes(cfg)) >= full  # the walk does see the whole rows' logits
    shapes = vocab_shapes(chunked)
    assert largest(shapes) < full  # ... the head's (d, vocab) weights are the largest here
    assert (B, 4, cfg.padded_vocab_size) in shapes  # one chunk's logits
    # XLA's own account: the compiled gradient's scratch memory shrinks by most of the fp32 logits
    # (measured on CPU: 2.59 -> 1.81 MB, the logits being 1.05 MB).
    assert _temp_bytes(chunked, batch) < _temp_bytes(cfg, batch) - 4 * full // 2


def _temp_bytes(cfg: ModelConfig, batch: dict) -> int:
    """XLA's temporary buffer bytes for the compiled loss gradient."""
    graphdef, params = _params(cfg)
    grad = jax.grad(training.loss_fn, has_aux=True)
    step = jax.jit(lambda p: grad(p, graphdef, batch, jax.random.key(5), ALPHA))
    return step.trace(params).lower().compile().memory_analysis().temp_size_in_bytes


@pytest.mark.skipif(len(CPUS) < 8, reason="needs the 8 simulated CPU devices of conftest.py")
def test_sharded_chunked_loss_equals_one_device():
    # Batch over "data", positions over "seq", vocab and d_inner over "tensor"; an untied head too.
    # The pure-JAX ops on both sides: on a GPU machine "auto" would pick Pallas for the CPU devices.
    cfg = dataclasses.replace(
        CFG,
        tie_embeddings=False,
        vocab_size=62,  # padded to 64
        mamba2=dataclasses.replace(CFG.mamba2, ssd_impl="chunked"),
        sparse=dataclasses.replace(CFG.sparse, impl="indexed"),
    )
    batch = _batch(vocab=cfg.vocab_size)
    with jax.default_device(CPUS[0]):
        want = _loss_grads_eval(cfg, batch)
    mesh = sharding.make_mesh(MeshConfig(data=2, seq=2, tensor=2), CPUS)
    state = nnx.state(LanguageModel(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    params = jax.device_put(nnx.to_pure_dict(state), sharding.param_shardings_dict(state, mesh))

    def rows(x):
        """x placed with its batch over "data" and positions over "seq"."""
        return jax.device_put(x, NamedSharding(mesh, P("data", *(["seq"] if x.ndim > 1 else []))))

    got = _loss_grads_eval(
        dataclasses.replace(cfg, loss_chunk=8), jax.tree.map(rows, batch), params, mesh
    )
    assert got[0].sharding.num_devices == 8
    _assert_same_scale(got, want)
