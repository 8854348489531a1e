"""mesh.param_gather="use" gathers in the compute dtype the parameters the model reads only cast to
it (hax_jax/gather.py), changing no number: which leaves qualify, the gathers XLA's partitioner
makes of them, and the training, on the simulated CPU devices of tests/conftest.py."""

import collections
import glob
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from collectives import collectives_of
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from tiny_runs import subprocess_xla_flags

import train
from hax_jax import checkpoint, gather, training

ROOT = Path(__file__).parents[2]
BF16 = jnp.bfloat16
AUTO = AxisType.Auto
TINY = ["configs/tiny.py", "model.dtype=bfloat16", "data.batch_size=8", "data.seq_len=128"]
TINY += ["data.task=mqar", "data.mqar.num_kv_pairs=8", "data.mqar.valid_size=16"]
AT_USE = ["mesh.data=8", "mesh.shard_optimizer=true", "mesh.param_gather=use"]


def test_cast_at_every_use_reads_through_calls():
    """A leaf qualifies when each of its uses, also inside jit, remat, scan or shard_map bodies,
    is a cast to the dtype; any other use (arithmetic, another dtype, a custom VJP, being
    returned) keeps it out."""

    @jax.custom_vjp
    def opaque(x):
        return x

    opaque.defvjp(lambda x: (x, None), lambda _, ct: (ct,))
    mesh = jax.make_mesh((2,), ("d",), devices=jax.devices()[:2])
    in_map = jax.shard_map(
        lambda w: w.astype(BF16).sum()[None], mesh=mesh, in_specs=P(), out_specs=P("d")
    )

    # A body that hands its input back out as it is (nnx.remat returns the module's state): the
    # call's output is the leaf too, so its uses count.
    passed_on = jax.checkpoint(lambda w: (w.astype(BF16).sum(), w))

    def fn(jitted, remat, scanned, mapped, handed, raw, other, mixed, custom, handed_raw, returned):
        total = jax.jit(lambda w: w.astype(BF16).sum())(jitted)
        total += jax.checkpoint(lambda w: w.astype(BF16).sum())(remat)
        total += jax.lax.scan(lambda c, _: (c + scanned.astype(BF16).sum(), None), 0.0, None, 3)[0]
        total += in_map(mapped).sum()
        value, handed = passed_on(handed)
        total += value + handed.astype(BF16).sum()
        total += (raw * 2).sum() + other.astype(jnp.float16).sum()
        total += mixed.astype(BF16).sum() + mixed.sum()
        total += opaque(custom).sum()
        value, handed_raw = passed_on(handed_raw)
        total += value + handed_raw.sum()
        return total, returned

    args = tuple(jnp.ones((4,), jnp.float32) for _ in range(11))
    flags = gather.cast_at_every_use(fn, args, BF16)
    assert flags == (True,) * 5 + (False,) * 6


def test_gathered_cast_changes_no_value_or_gradient():
    """A leaf read only cast to bf16, gathered cast: the same values and the same fp32 gradient,
    also where two casts of it each pass back an fp32 cotangent and they sum to a value bf16
    cannot hold."""
    mesh = jax.make_mesh((2,), ("d",), devices=jax.devices()[:2], axis_types=(AUTO,))
    split, whole = NamedSharding(mesh, P("d")), NamedSharding(mesh, P())
    rng = np.random.default_rng(0)
    p = jax.device_put(jnp.asarray(rng.standard_normal((8, 4)), jnp.float32), split)
    a, b = (jnp.asarray(rng.standard_normal((4,)), BF16) for _ in range(2))

    def loss(w):
        first = (w.astype(BF16) @ a).astype(jnp.float32)
        second = (w.astype(BF16) @ b).astype(jnp.float32)
        return jnp.sum(first * first) + jnp.sum(jnp.sin(second))

    def through(cast):
        def fn(w):
            return loss(
                gather.gathered({"w": w}, {"w": split}, {"w": whole}, {"w": cast}, BF16)["w"]
            )

        return jax.jit(jax.value_and_grad(fn))(p)

    (value, grad), (value_cast, grad_cast) = through(False), through(True)
    assert value_cast == value
    np.testing.assert_array_equal(np.asarray(grad_cast), np.asarray(grad))
    assert not np.array_equal(np.asarray(grad), np.asarray(grad.astype(BF16).astype(jnp.float32)))


def _trainer(tmp_path, extra):
    cfg = train.resolve_config([*TINY, *extra, f"workdir={tmp_path}"])
    mesh = train.sharding.make_mesh(cfg.mesh)
    return cfg, mesh


def _castable(cfg, trainer, batch) -> dict:
    """{leaf path: whether the model reads it only cast to bf16}."""
    graphdef = nnx.split(checkpoint.abstract_model(cfg.model), nnx.Param)[0]
    flags = gather.cast_at_every_use(
        lambda p, b: training.loss_fn(p, graphdef, b, jax.random.key(0), 0.0),
        (trainer.state.params, batch),
        BF16,
    )[0]
    return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(flags)}


@pytest.mark.parametrize("remat", ["none", "block"])
def test_the_models_matmul_kernels_are_read_cast_and_nothing_else(tmp_path, remat):
    """In the tiny Mamba / Mamba-2 LM, blocks recomputed or not: the projections' kernels
    (in_proj part by part, x_proj, dt_proj, out_proj) are read only cast to bf16; what the model
    computes with in fp32 (A, D, dt_bias, the norms' and the conv's weights) is not."""
    cfg, mesh = _trainer(tmp_path, [*AT_USE, f"model.remat={remat}"])
    with jax.set_mesh(mesh):
        trainer = train.Trainer(cfg, Path(cfg.workdir), mesh)
        castable = _castable(cfg, trainer, trainer.batch(next(trainer.iterator)))
        trainer.close()
    cast = {k for k, v in castable.items() if v}
    assert cast and all(re.search(r"(in|x|dt|out)_proj'\]\['(kernel|bias)", k) for k in cast)
    assert all(castable[k] for k in castable if re.search(r"(in|out)_proj'\]\['kernel", k))
    kept = [k for k in castable if re.search(r"A_log|'D'|dt_bias|norm|conv1d", k)]
    assert kept and not any(castable[k] for k in kept)


# Compiles the step in a process of its own, without the compilation cache, dumping the HLO after
# XLA's SPMD partitioning (a program found in a cache, on disk or in memory, is not compiled).
_COMPILE = """
import sys
from pathlib import Path
import jax
import train
cfg = train.resolve_config(sys.argv[1:])
mesh = train.sharding.make_mesh(cfg.mesh)
with jax.set_mesh(mesh):
    trainer = train.Trainer(cfg, Path(cfg.workdir), mesh)
    trainer.step_fn.lower(trainer.state, trainer.batch(next(trainer.iterator))).compile()
    trainer.close()
"""


def _after_partitioning(kind, overrides, tmp_path) -> collections.Counter:
    """{(dtype, shape): count} of the arrays `kind` collectives (e.g. "all-gather") move in the
    step as XLA's partitioner makes it (before the CPU backend widens bf16 collectives to fp32,
    which GPUs do not)."""
    dump = tmp_path / "dump"
    flags = f" --xla_dump_to={dump} --xla_dump_hlo_pass_re=spmd-partitioning"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_ENABLE_COMPILATION_CACHE": "false"}
    env["XLA_FLAGS"] = subprocess_xla_flags(8) + flags
    argv = [*overrides, f"workdir={tmp_path / 'compiled'}"]
    subprocess.run([sys.executable, "-c", _COMPILE, *argv], env=env, cwd=ROOT, check=True)
    (path,) = glob.glob(str(dump / "*jit_train_step*after_spmd-partitioning*"))
    found = re.findall(rf"= (\w+)\[([\d,]*)\]\S* {kind}\(", Path(path).read_text())
    shapes = [(dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in found]
    return collections.Counter(shapes)


def test_the_parameters_read_cast_are_gathered_cast(tmp_path):
    """Each parameter the update splits is gathered once as the step opens: in bf16 where the
    model reads it only cast to bf16, else in fp32."""
    cfg, mesh = _trainer(tmp_path, AT_USE)
    with jax.set_mesh(mesh):
        trainer = train.Trainer(cfg, Path(cfg.workdir), mesh)
        batch = trainer.batch(next(trainer.iterator))
        castable = _castable(cfg, trainer, batch)
        split = {
            jax.tree_util.keystr(k): leaf.shape
            for k, leaf in jax.tree_util.tree_leaves_with_path(trainer.state.params)
            if not leaf.sharding.is_fully_replicated
        }
        trainer.close()
    gathers = _after_partitioning("all-gather", [*TINY, *AT_USE], tmp_path)
    expected = collections.Counter(
        ("bf16" if castable[k] else "f32", shape) for k, shape in split.items()
    )
    assert expected[("bf16", (64, 128))] > 0  # the Mamba-2 in_proj's x part among them
    assert gathers == expected


@pytest.mark.gpu
def test_the_gathers_stay_cast_on_gpus(tmp_path):
    """On 2 GPUs, XLA:GPU's compiled step gathers the leaves read only cast in bf16, as the
    partitioner makes them on CPUs (whose backend then widens them)."""
    if len(jax.devices("gpu")) < 2:
        pytest.skip("needs 2 GPUs")
    cfg, mesh = _trainer(tmp_path, ["mesh.data=2", *AT_USE[1:]])
    with jax.set_mesh(mesh):
        trainer = train.Trainer(cfg, Path(cfg.workdir), mesh)
        batch = trainer.batch(next(trainer.iterator))
        castable = _castable(cfg, trainer, batch)
        shapes = _shapes(trainer.state.params)
        hlo = trainer.step_fn.lower(trainer.state, batch).compile().as_text()
        trainer.close()
    gathered = collections.Counter(
        (m.group(1), tuple(int(d) for d in m.group(2).split(",") if d))
        for kind, result in collectives_of(hlo)
        if kind == "all-gather"
        for m in re.finditer(r"(\w+)\[([\d,]*)\]", result)
    )
    assert gathered[("bf16", shapes["['layers'][2]['mixer']['in_proj']['kernel']['x']"])] > 0
    f32 = {shape for dtype, shape in gathered if dtype == "f32"}
    assert not f32 & _cast_only(castable, shapes)


def _shapes(params) -> dict:
    """{leaf path: shape}."""
    return {
        jax.tree_util.keystr(k): x.shape for k, x in jax.tree_util.tree_leaves_with_path(params)
    }


def _cast_only(castable: dict, shapes: dict, *, transposed=False) -> set:
    """The shapes that only leaves read cast have (with `transposed`, their reverses too: a
    matmul's weight gradient may come out transposed)."""
    kept = {shapes[k] for k, cast in castable.items() if not cast}
    cast = {shapes[k] for k, cast in castable.items() if cast}
    if transposed:
        cast |= {shape[::-1] for shape in cast}
    return cast - kept


def test_the_gradients_of_leaves_read_cast_are_summed_cast(tmp_path):
    """Plain data parallelism: each device's gradient of a kernel the model reads only cast to
    bf16 is a bf16 matmul's, and it is summed over "data" in bf16, in_proj's parts too (their
    shard_map gets them cast and joined, so its backward sums one bf16 array a layer); fp32 sums
    are left to the leaves the model computes with in fp32."""
    cfg, mesh = _trainer(tmp_path, ["mesh.data=8"])
    with jax.set_mesh(mesh):
        trainer = train.Trainer(cfg, Path(cfg.workdir), mesh)
        castable = _castable(cfg, trainer, trainer.batch(next(trainer.iterator)))
        shapes = _shapes(trainer.state.params)
        trainer.close()
    sums = _after_partitioning("all-reduce", [*TINY, "mesh.data=8"], tmp_path)

    def joined(layer):
        """(d_model, the channels of in_proj's parts side by side) of a layer."""
        prefix = f"['layers'][{layer}]['mixer']['in_proj']['kernel']"
        parts = [shape for k, shape in shapes.items() if k.startswith(prefix)]
        return parts[0][0], sum(math.prod(shape[1:]) for shape in parts)

    assert cfg.model.mixer_kinds[1:3] == ("mamba", "mamba2")
    assert sums[("bf16", joined(1))] > 0 and sums[("bf16", joined(2))] > 0
    assert sums[("bf16", shapes["['layers'][2]['mixer']['in_proj']['kernel']['B']"])] == 0
    f32 = {shape for dtype, shape in sums if dtype == "f32"}
    assert not f32 & _cast_only(castable, shapes, transposed=True)


@pytest.mark.parametrize("layout", ["mesh.data=8", "mesh.data=4 mesh.seq=2"])
def test_gathering_cast_trains_the_same(tmp_path, layout):
    """Two steps with the parameters gathered at use (cast where read cast) end with the same
    parameters and moments as gathering them whole at the update's end; under seq=2 in_proj's
    kernels are read twice (the conv window's projection too), so their gradient is a sum."""
    states = {}
    for gather_at in ("update", "use"):
        overrides = [*layout.split(), "mesh.shard_optimizer=true", f"mesh.param_gather={gather_at}"]
        cfg, mesh = _trainer(tmp_path / gather_at, overrides)
        with jax.set_mesh(mesh):
            trainer = train.Trainer(cfg, Path(cfg.workdir), mesh)
            batch = trainer.batch(next(trainer.iterator))
            state = trainer.state
            for _ in range(2):
                state, _ = trainer.step_fn(state, batch)
            states[gather_at] = jax.tree.map(np.asarray, (state.params, state.opt_state))
            trainer.close()
    for a, b in zip(*(jax.tree.leaves(s) for s in states.values()), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
