"""train.py end to end: exact resume, sharded == single device, NaN stop, SIGTERM, init_from,
errors."""

import dataclasses
import gc
import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from collectives import arrays, collectives_of
from flax import nnx
from scripts import load_script
from tiny_runs import TINY_JOINT_RECALL, subprocess_xla_flags

import hax_jax
from hax_jax import config as config_lib
from hax_jax import optim, training

ROOT = Path(__file__).parents[2]
train = load_script("train.py", "train_script")

# A few-second joint recall run: 2 x 2 tables (37 positions), d_model 32.
SMALL = [
    str(ROOT / "configs/main.py"),
    "model.d_model=32",
    "model.mamba2.headdim=16",
    "model.mamba2.d_state=16",
    *TINY_JOINT_RECALL,
    "model.sparse.num_keys=8",
    "train.progress=false",
    "optim.warmup_steps=5",
]
# Every mixer kind in one model on MQAR rows of 32 positions (divisible by every mesh axis).
ALL_KINDS = [
    str(ROOT / "configs/tiny.py"),
    "model.n_layer=6",
    "model.block_pattern=mamba2,mamba,attention,swa,mlp,infini",
    "model.d_model=32",
    "model.vocab_size=64",
    "model.mamba2.headdim=8",
    "model.mamba2.chunk_size=8",  # seq = 2 shards of 16 positions: whole chunks
    "model.attention.window=8",
    "model.infini.segment_len=8",
    "data.task=mqar",
    "data.seq_len=32",
    "data.batch_size=4",
    "data.mqar.num_kv_pairs=4",
    "data.mqar.stage_examples=64",
    "data.mqar.valid_size=8",
    "train.progress=false",
    "optim.warmup_steps=2",
]


def _losses(workdir: Path, key: str = "loss") -> dict[int, float]:
    """step -> value of `key` in workdir/metrics.jsonl."""
    lines = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {m["step"]: m[key] for m in lines if key in m}


def test_resume_continues_exactly(tmp_path):
    cadence = ["train.log_every=1", "train.eval_every=20", "train.checkpoint_every=10"]
    train.main([*SMALL, *cadence, f"workdir={tmp_path / 'straight'}", "train.num_steps=40"])
    train.main([*SMALL, *cadence, f"workdir={tmp_path / 'resumed'}", "train.num_steps=20"])
    assert max(_losses(tmp_path / "resumed")) == 20
    # A run killed after step 20's checkpoint may have logged steps past it: the resume drops them.
    with open(tmp_path / "resumed" / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 23, "loss": 99.0}) + "\n")
    train.main([*SMALL, *cadence, f"workdir={tmp_path / 'resumed'}", "train.num_steps=40"])
    straight, resumed = _losses(tmp_path / "straight"), _losses(tmp_path / "resumed")
    assert sorted(straight) == sorted(resumed) == list(range(1, 41))
    logged = (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in logged if '"loss"' in x] == list(range(1, 41))
    np.testing.assert_allclose(
        [resumed[s] for s in range(1, 41)], [straight[s] for s in range(1, 41)], rtol=0, atol=1e-6
    )
    # The losses change from step to step: a restarted (not resumed) iterator would show.
    assert len({round(v, 6) for v in straight.values()}) > 30
    # Step s logs the learning rate its update applied: the schedule's value after s - 1 updates.
    cfg = train.resolve_config([*SMALL, "train.num_steps=40"])
    schedule = optim.learning_rate(cfg.optim, cfg.train.num_steps)
    logged_lr = _losses(tmp_path / "straight", "lr")
    np.testing.assert_allclose(
        [logged_lr[s] for s in range(1, 41)], [float(schedule(s - 1)) for s in range(1, 41)]
    )
    assert _losses(tmp_path / "resumed", "valid_accuracy")[40] == pytest.approx(
        _losses(tmp_path / "straight", "valid_accuracy")[40], abs=1e-6
    )
    assert list((tmp_path / "straight" / "tensorboard").glob("events.out.tfevents.*"))


def _trainer(argv: list[str], workdir: Path):
    """A Trainer built as train.main builds it (state initialised or restored), not yet run."""
    cfg = train.resolve_config([*argv, f"workdir={workdir}"])
    workdir.mkdir(parents=True)
    mesh = train.sharding.make_mesh(cfg.mesh)
    with jax.set_mesh(mesh):
        return train.Trainer(cfg, workdir, mesh)


def _sharded_run(tmp_path, name, mesh, extra, base=ALL_KINDS):
    """Trains 3 steps at fp32 on the given mesh; returns the losses and the trainer's parameters."""
    argv = [
        *base,
        *extra,
        *mesh,
        "train.num_steps=3",
        "train.log_every=1",
        "model.dtype=float32",
    ]
    trainer = _trainer(argv, tmp_path / name)
    with jax.set_mesh(trainer.mesh):
        trainer.run()
    return _losses(tmp_path / name), trainer.state.params


def _pretrained_without_branch(argv: list[str], path: Path, seed: int) -> hax_jax.LanguageModel:
    """Saves (and returns) a model of argv's model config with no sparse branch, as a released
    one."""
    cfg = config_lib.apply_overrides(
        config_lib.load_config_file(argv[0]),
        [o for o in argv[1:] if o.startswith("model.")] + ["model.sparse.pattern="],
    )
    model = hax_jax.LanguageModel(cfg.model, rngs=nnx.Rngs(seed))
    hax_jax.save_pretrained(model, path)
    return model


@pytest.mark.skipif(
    jax.device_count() < 8, reason="needs 8 devices of the default backend (CPU CI simulates them)"
)
def test_sharded_training_equals_one_device(tmp_path):
    # One model holds every mixer kind; its mamba and mamba2 layers carry the HAX branch.
    # (tests/hax_jax/test_sharding.py checks each kind alone, with and without the branch.)
    extra = ["model.sparse.pattern=lsh+ks", "model.sparse.num_keys=8", "model.sparse.max_len=32"]
    one, _ = _sharded_run(tmp_path, "one", ["mesh.data=1", "mesh.seq=1", "mesh.tensor=1"], extra)
    many, params = _sharded_run(
        tmp_path, "many", ["mesh.data=2", "mesh.seq=2", "mesh.tensor=2"], extra
    )
    assert sorted(one) == sorted(many) == [1, 2, 3]
    np.testing.assert_allclose([many[s] for s in one], [one[s] for s in one], rtol=1e-4)
    # Parameters really are split: the vocab over "tensor", d_inner over "tensor".
    assert "tensor" in params["embedding"]["embedding"].sharding.spec
    assert "tensor" in params["layers"][0]["mixer"]["in_proj"]["kernel"]["x"].sharding.spec
    assert len(params["embedding"]["embedding"].addressable_shards) == 8


def test_nan_loss_stops_after_saving_the_last_good_state(tmp_path):
    workdir = tmp_path / "nan"
    argv = [*SMALL, f"workdir={workdir}", "train.num_steps=50", "train.log_every=1"]
    with pytest.raises(FloatingPointError, match="non-finite training loss"):
        train.main([*argv, "optim.peak_lr=1e30", "optim.warmup_steps=1", "optim.clip_norm=0"])
    manager = hax_jax.checkpoint.train_checkpointer(workdir, 3)
    step = manager.latest_step()
    assert step is not None and step < 50
    restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))[
        "state"
    ]
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(restored["params"]))


def test_sigterm_saves_and_resumes(tmp_path):
    workdir = tmp_path / "term"
    cmd = [sys.executable, str(ROOT / "train.py"), *SMALL, f"workdir={workdir}"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": subprocess_xla_flags()}
    proc = subprocess.Popen([*cmd, "train.num_steps=100000", "train.log_every=1"], env=env)
    metrics = workdir / "metrics.jsonl"
    for _ in range(1200):  # up to 10 minutes, polled every 0.5 s (no busy-wait)
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 5:
            break
        assert proc.poll() is None, "train.py exited before it was signalled"
        time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("train.py logged fewer than 5 steps in 10 minutes")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0
    saved = hax_jax.checkpoint.train_checkpointer(workdir, 3).latest_step()
    assert saved == max(_losses(workdir))
    train.main([*SMALL, f"workdir={workdir}", f"train.num_steps={saved + 3}", "train.log_every=1"])
    assert sorted(_losses(workdir)) == list(range(1, saved + 4))


def test_init_from_loads_the_pretrained_parameters(tmp_path):
    pretrained = _pretrained_without_branch(SMALL, tmp_path / "pre", seed=7)
    state = _trainer([*SMALL, f"train.init_from={tmp_path / 'pre'}"], tmp_path / "w").state
    want = nnx.to_pure_dict(nnx.state(pretrained, nnx.Param))
    np.testing.assert_array_equal(
        state.params["layers"][0]["mixer"]["in_proj"]["kernel"]["x"],
        want["layers"][0]["mixer"]["in_proj"]["kernel"]["x"],
    )
    assert "branch" in state.params["layers"][0]["mixer"]  # the HAX branch is new: kept at its init
    with pytest.raises(
        ValueError,
        match=(
            r"does not match the model: "
            r"embedding/embedding has shape \(100, 32\) there, \(100, 64\)"
        ),
    ):
        train.main(
            [
                *SMALL,
                f"workdir={tmp_path / 'x'}",
                "model.d_model=64",
                f"train.init_from={tmp_path / 'pre'}",
            ]
        )


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.num_stepz=3", "unknown config key 'train.num_stepz'"),
        ("train.num_steps=many", "config key 'train.num_steps' expects int, got 'many'"),
        (
            "mesh.data=64",
            f"mesh data=64 x seq=1 x tensor=1 = 64 devices, but only {jax.device_count()} are",
        ),
    ],
)
def test_bad_command_lines_fail_naming_the_value(tmp_path, override, message):
    with pytest.raises(ValueError, match=message):
        train.main([*SMALL, f"workdir={tmp_path}", override])


def _stand_in_mesh(platform: str, seq: int):
    """What step_compiler_options reads of a mesh: its devices' platform and its "seq" size."""
    device = types.SimpleNamespace(platform=platform)
    return types.SimpleNamespace(devices=np.array([device]), shape={"seq": seq})


@pytest.mark.parametrize(
    "combine, platform, seq, threshold",
    [
        ("auto", "gpu", 2, "block"),
        ("auto", "gpu", 1, None),
        ("auto", "cpu", 2, None),
        ("auto", "tpu", 4, None),
        ("on", "gpu", 2, None),
        ("off", "gpu", 1, 1),
        ("block", "gpu", 2, "block"),
        ("block", "gpu", 1, "block"),
    ],
)
def test_collective_combining_follows_the_setting(combine, platform, seq, threshold):
    """Joining of all-reduces, reduce-scatters and all-gathers is limited to one block's gradients
    where GPUs split the sequence by default and under "block", off (threshold 1) under "off"."""
    cfg = config_lib.apply_overrides(config_lib.load_config_file(ALL_KINDS[0]), ALL_KINDS[1:])
    abstract = nnx.split(hax_jax.checkpoint.abstract_model(cfg.model), nnx.Param)[1]
    replicated = jax.tree.map(lambda _: _replicated(), nnx.to_pure_dict(abstract))
    mesh_cfg = config_lib.MeshConfig(combine_collectives=combine)
    options = training.step_compiler_options(
        mesh_cfg, _stand_in_mesh(platform, seq), abstract, replicated
    )
    if threshold == "block":
        threshold = training.largest_block_bytes(abstract, replicated)
        assert threshold > 1
    kinds = ("all_reduce", "reduce_scatter", "all_gather")
    want = {f"xla_gpu_{kind}_combine_threshold_bytes": threshold for kind in kinds}
    assert options == ({} if threshold is None else want)


def _replicated():
    return jax.sharding.NamedSharding(jax.make_mesh((1,), ("data",)), jax.P())


@pytest.mark.parametrize("combine", ["off", "block"])
def test_gpu_only_collective_combining_is_refused_off_gpus(combine):
    mesh_cfg = config_lib.MeshConfig(combine_collectives=combine)
    with pytest.raises(ValueError, match=rf"combine_collectives='{combine}' .* devices are tpu"):
        training.step_compiler_options(mesh_cfg, _stand_in_mesh("tpu", 2))


def test_the_largest_block_is_counted_in_one_devices_bytes():
    """largest_block_bytes against the bytes device 0 holds of each block's parameters, placed
    for real with tensor=2 (split ones count half)."""
    cfg = config_lib.apply_overrides(
        config_lib.load_config_file(ALL_KINDS[0]), [*ALL_KINDS[1:], "mesh.data=4", "mesh.tensor=2"]
    )
    mesh = train.sharding.make_mesh(cfg.mesh)
    abstract = nnx.split(hax_jax.checkpoint.abstract_model(cfg.model), nnx.Param)[1]
    shardings = training.param_shardings(abstract, mesh, cfg.mesh).use
    held, whole = {}, {}
    params = nnx.to_pure_dict(abstract)
    for i, layer in params["layers"].items():
        leaves = list(zip(jax.tree.leaves(layer), jax.tree.leaves(shardings["layers"][i])))
        held[i] = sum(
            jax.device_put(np.zeros(x.shape, x.dtype), sh).addressable_shards[0].data.nbytes
            for x, sh in leaves
        )
        whole[i] = sum(np.zeros(x.shape, x.dtype).nbytes for x, _ in leaves)
    largest = max(held, key=held.get)
    assert len(set(held.values())) > 1  # the kinds' blocks differ in size
    assert held[largest] < whole[largest]  # and tensor=2 splits some of the largest's parameters
    assert training.largest_block_bytes(abstract, shardings) == max(held.values())
    # fsdp splits d_model over "data" after the gradients' reduction: the bytes stay.
    fsdp = dataclasses.replace(cfg.mesh, fsdp=True)
    fsdp_shardings = training.param_shardings(abstract, mesh, fsdp).use
    assert fsdp_shardings != shardings
    assert training.largest_block_bytes(abstract, fsdp_shardings) == max(held.values())


# Mamba-2 blocks the GPU kernels take (chunks of 64) on rows of 256: 2 shards of 2 chunks.
GPU_MAMBA2 = [
    str(ROOT / "configs/tiny.py"),
    "model.block_pattern=mamba2",
    "model.mamba2.headdim=32",
    *ALL_KINDS[ALL_KINDS.index("data.task=mqar") :],
    "data.seq_len=256",
    "data.batch_size=2",
]


@pytest.mark.gpu
def test_a_split_sequence_on_gpus_joins_all_reduces_up_to_a_block(tmp_path):
    """On 2 GPUs with seq=2, the train step's compile joins all-reduces up to a block's gradients
    ("auto" and "block"): fewer all-reduces than never joined ("off"), and no fewer than with
    XLA's own joining ("on"); the same collectives otherwise."""
    if len(jax.devices("gpu")) < 2:
        pytest.skip("needs 2 GPUs")
    settings = ("off", "auto", "block", "on")
    counts = {}
    for combine in settings:
        argv = [*GPU_MAMBA2, "mesh.data=1", "mesh.seq=2", f"mesh.combine_collectives={combine}"]
        trainer = _trainer(argv, tmp_path / combine)
        with jax.set_mesh(trainer.mesh):
            batch = trainer.batch(next(trainer.iterator))
            hlo = trainer.step_fn.lower(trainer.state, batch).compile().as_text()
        trainer.close()
        kinds = [kind for kind, _ in collectives_of(hlo)]
        counts[combine] = {kind: kinds.count(kind) for kind in set(kinds)}
    off, auto, block, on = (counts[c].pop("all-reduce") for c in settings)
    assert off > auto == block >= on
    assert counts["off"] == counts["auto"] == counts["block"] == counts["on"]


def test_the_loop_freezes_the_compiled_steps_objects_and_releases_them(tmp_path):
    trainer = _trainer([*SMALL, "train.num_steps=3"], tmp_path / "run")
    frozen_at_call, step_fn = [], trainer.step_fn
    before = gc.get_freeze_count()  # 0 here; the GPU machines' Python starts with some frozen

    def recording(state, batch):
        frozen_at_call.append(gc.get_freeze_count())
        return step_fn(state, batch)

    trainer.step_fn = recording
    with jax.set_mesh(trainer.mesh):
        trainer.run()
    trainer.close()
    assert frozen_at_call[0] == before and all(count > before for count in frozen_at_call[1:])
    assert len(frozen_at_call) == 3
    assert gc.get_freeze_count() == 0  # released, whatever was frozen before (heap.py)


def test_a_workdir_of_another_model_is_refused(tmp_path):
    train.main([*SMALL, f"workdir={tmp_path}", "train.num_steps=2"])
    with pytest.raises(ValueError, match=r"another model config \(model.d_model: checkpoint 32"):
        train.main([*SMALL, f"workdir={tmp_path}", "train.num_steps=4", "model.d_model=64"])


def test_init_from_a_mamba_starts_the_hax_qk_projection_from_b_and_c(tmp_path):
    # HAX App. D.2: the query/key projection of the new branch starts as the SSM's C / B
    # projections.
    argv = [*SMALL, "model.block_pattern=mamba", "model.mamba.dt_rank=2"]
    pretrained = _pretrained_without_branch(argv, tmp_path / "pre", seed=3)
    trainer = _trainer([*argv, f"train.init_from={tmp_path / 'pre'}"], tmp_path / "w")
    mixer = trainer.state.params["layers"][1]["mixer"]
    x_proj = np.asarray(pretrained.layers[1].mixer.x_proj.kernel[...])
    n = pretrained.cfg.mamba.d_state
    qk = np.asarray(mixer["branch"]["qk_proj"]["kernel"])
    np.testing.assert_array_equal(qk, np.concatenate([x_proj[:, 2 : 2 + n], x_proj[:, 2 + n :]], 1))


def test_a_mesh_that_cannot_split_a_parameter_is_refused(tmp_path):
    """mesh.tensor=8 cannot split SMALL's 100-token vocabulary: refused before training, naming
    the parameter, its size and the mesh axis (it used to stay whole on every device, silently)."""
    with pytest.raises(ValueError, match=r"embedding/embedding \(vocab = 100\) over mesh.tensor=8"):
        train.main([*SMALL, f"workdir={tmp_path}", "mesh.data=1", "mesh.tensor=8"])


def test_a_tensor_size_that_splits_groups_apart_is_refused(tmp_path):
    """Two B / C groups over mesh.tensor=4 would cut a group's state apart (its heads could not
    read it): refused, naming the group parameters (one group is replicated, by design)."""
    with pytest.raises(ValueError, match=r"mixer/\S+/B \(groups = 2\) over mesh.tensor=4"):
        train.main(
            [
                *SMALL,
                f"workdir={tmp_path}",
                "mesh.data=1",
                "mesh.tensor=4",
                "model.mamba2.ngroups=2",
            ]
        )


# A Mamba-2 + Mamba LM on MQAR rows of 32 positions, batch 4: a few seconds a run.
TWO_KINDS = [
    str(ROOT / "configs/tiny.py"),
    "model.n_layer=2",
    "model.d_model=32",
    "model.vocab_size=64",
    "model.mamba2.headdim=8",
    "model.mamba2.chunk_size=8",
    *ALL_KINDS[ALL_KINDS.index("data.task=mqar") :],
]


def _split_over(x: jax.Array, axis: str) -> bool:
    """Whether some axis of x is split over the mesh axis `axis`."""
    return any(a == axis or (isinstance(a, tuple) and axis in a) for a in x.sharding.spec)


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (CPU CI simulates 8)")
def test_sharded_optimizer_trains_as_one_device(tmp_path):
    """mesh.shard_optimizer: the moments split over "data" and "seq" (every device of both holds a
    whole replica of the parameters), the parameters whole, the same training."""
    data2_seq2 = ["mesh.data=2", "mesh.seq=2", "mesh.tensor=1"]
    one, one_params = _sharded_run(tmp_path, "one", ["mesh.data=1"], [], TWO_KINDS)
    sharded = ["mesh.shard_optimizer=true"]
    split, params = _sharded_run(tmp_path, "split", data2_seq2, sharded, TWO_KINDS)
    assert sorted(one) == sorted(split) == [1, 2, 3]
    np.testing.assert_allclose([split[s] for s in one], [one[s] for s in one], rtol=1e-4)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(one_params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)

    trainer = _trainer([*TWO_KINDS, *data2_seq2, *sharded, "model.dtype=float32"], tmp_path / "hlo")
    with jax.set_mesh(trainer.mesh):
        batch = trainer.batch(next(trainer.iterator))
        hlo = trainer.step_fn.lower(trainer.state, batch).compile().as_text()
    embedding = trainer.state.params["embedding"]["embedding"]  # (vocab, d_model)
    moments = [m for m in jax.tree.leaves(trainer.state.opt_state) if m.shape == embedding.shape]
    assert moments and not any(_split_over(embedding, a) for a in ("data", "seq"))
    assert all(_split_over(m, a) for m in moments for a in ("data", "seq"))
    trainer.close()
    # Each device updates its slice, and the new parameters are gathered whole. (XLA's CPU backend
    # all-reduces the gradients and slices them; on GPUs the same pattern reduce-scatters.)
    assert ("all-gather", embedding.shape) in arrays(collectives_of(hlo))

    # mesh.param_gather="use": the parameters rest split like the moments and are gathered at the
    # step's start; the same training, also across a resume that moves them back to resting whole.
    at_use = [*TWO_KINDS, *data2_seq2, *sharded, "model.dtype=float32", "train.log_every=1"]
    at_use += ["train.checkpoint_every=2", f"workdir={tmp_path / 'at_use'}"]
    train.main([*at_use, "mesh.param_gather=use", "train.num_steps=2"])
    train.main([*at_use, "train.num_steps=3"])
    resumed = _losses(tmp_path / "at_use")
    np.testing.assert_allclose([resumed[s] for s in one], [one[s] for s in one], rtol=1e-4)
    cfg = train.resolve_config([*at_use, "mesh.param_gather=use", "train.num_steps=3"])
    mesh = train.sharding.make_mesh(cfg.mesh)
    with jax.set_mesh(mesh):
        trainer = train.Trainer(cfg, Path(cfg.workdir), mesh)  # restores step 3, split
    embedding = trainer.state.params["embedding"]["embedding"]
    assert all(_split_over(embedding, a) for a in ("data", "seq"))
    leaves = jax.tree.leaves(trainer.state.params)
    for a, b in zip(leaves, jax.tree.leaves(one_params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    trainer.close()


def test_param_gather_at_use_needs_the_sharded_optimizer(tmp_path):
    """mesh.param_gather="use" gathers what mesh.shard_optimizer splits: without it, or with fsdp
    (which gathers each parameter where it is used), train.py stops naming the settings."""
    for settings in (["mesh.param_gather=use"], ["mesh.param_gather=use", "mesh.fsdp=true"]):
        with pytest.raises(ValueError, match="mesh.param_gather='use'.*shard_optimizer=false"):
            _trainer([*TWO_KINDS, "mesh.data=1", *settings], tmp_path / str(len(settings)))


def test_error_line_names_the_value_and_what_would_fit_in_memory():
    """train.py's one error line: the message of bad input; for XLA running out of device memory,
    the allocation and the settings that would fit; another runtime error keeps its traceback."""
    assert training.error_line(ValueError("data.batch_size=3")) == "error: data.batch_size=3"
    oom = jax.errors.JaxRuntimeError(
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 86.63GiB with allocator "
        "GPU_0_bfc on device 0. [tf-allocator-allocation-error=''] [executable_name='jit_step']"
    )
    line = training.error_line(oom)
    assert line.startswith("error: the train step does not fit the device memory (Out of memory")
    assert "allocate 86.63GiB with allocator GPU_0_bfc on device 0)" in line
    for setting in (
        "data.batch_size",
        "model.remat=block_keep_scan",
        "model.remat=block ",
        "mesh.fsdp=true",
        "mesh.seq",
    ):
        assert setting in line
    assert "\n" not in line and "tf-allocator" not in line
    other = jax.errors.JaxRuntimeError("INTERNAL: a kernel failed")
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        training.error_line(other)
