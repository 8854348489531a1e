"""Multi-process training on CPU: two local processes (jax.distributed, gloo), 4 simulated devices
each, started as the README says (one train.py per process with the JAX_* variables), against one
process with 8 devices."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tiny_runs import subprocess_xla_flags

ROOT = Path(__file__).parents[2]
# A Mamba-2 and a Mamba layer (both split over seq and tensor) on MQAR rows of 32 positions.
TINY = [
    str(ROOT / "configs/tiny.py"),
    "model.n_layer=2",
    "model.block_pattern=mamba2,mamba",
    "model.d_model=32",
    "model.vocab_size=64",
    "model.mamba2.headdim=8",
    "model.mamba2.chunk_size=8",
    "model.dtype=float32",
    "data.task=mqar",
    "data.seq_len=32",
    "data.mqar.num_kv_pairs=4",
    "data.mqar.stage_examples=64",
    "data.mqar.valid_size=8",
    "train.progress=false",
    "train.log_every=1",
    "train.eval_every=100",
    "optim.warmup_steps=2",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(script: Path, args: list[str], processes: int, logs: Path, timeout: float = 300):
    """Runs `script args` in `processes` processes of 8 // processes CPU devices each, as a user
    launches train.py; returns each process's (returncode, stderr). stderr goes to files in
    `logs` (gloo's chatter would fill a pipe and block the process)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": subprocess_xla_flags(8 // processes)}
    if processes > 1:
        env["JAX_COORDINATOR_ADDRESS"] = f"127.0.0.1:{_free_port()}"
        env["JAX_NUM_PROCESSES"] = str(processes)
    logs.mkdir(parents=True, exist_ok=True)
    paths = [logs / f"stderr-{i}.txt" for i in range(processes)]
    procs = []
    for i, path in enumerate(paths):
        with open(path, "w") as err:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script), *args],
                    env={**env, "JAX_PROCESS_ID": str(i)} if processes > 1 else env,
                    stderr=err,
                )
            )
    try:
        return [
            (p.wait(timeout=timeout), path.read_text())
            for p, path in zip(procs, paths, strict=True)
        ]
    finally:
        for p in procs:
            p.kill()


def _train(workdir: Path, processes: int, mesh: str, *extra: str) -> None:
    """train.py on `workdir`; every process must exit 0."""
    args = [*TINY, *mesh.split(), f"workdir={workdir}", *extra]
    for rc, err in _launch(ROOT / "train.py", args, processes, workdir.parent / "logs"):
        assert rc == 0, err[-3000:]


def _losses(workdir: Path) -> dict[int, float]:
    lines = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {m["step"]: m["loss"] for m in lines if "loss" in m}


def test_two_processes_train_and_resume_as_one(tmp_path):
    """Losses of two processes equal one process's with the same 8-device mesh (fp32, 1e-4),
    and a run stopped at its step-2 checkpoint resumes to the same losses; config.json is written
    once, metrics by process 0 only."""
    mesh, size = "mesh.data=2 mesh.seq=2 mesh.tensor=2", "data.batch_size=4"
    _train(tmp_path / "one", 1, mesh, size, "train.num_steps=4")
    two = tmp_path / "two"
    _train(two, 2, mesh, size, "train.num_steps=2", "train.checkpoint_every=2")
    _train(two, 2, mesh, size, "train.num_steps=4", "train.checkpoint_every=2")
    one_losses, two_losses = _losses(tmp_path / "one"), _losses(two)
    assert sorted(one_losses) == sorted(two_losses) == [1, 2, 3, 4]
    np.testing.assert_allclose(
        [two_losses[s] for s in one_losses], list(one_losses.values()), rtol=1e-4
    )
    assert (two / "config.json").is_file()
    assert sorted((two / "checkpoints").iterdir())[-1].name == "4"


@pytest.mark.parametrize(
    "mesh, batch, rows",
    [
        # Each process feeds 4 of the 8 rows.
        ("mesh.data=8", 8, [[0, 4], [4, 8]]),
        # "data" splits nothing across processes: both feed both rows (2 < 8 devices), each its
        # half of the positions.
        ("mesh.data=1 mesh.seq=2 mesh.tensor=4", 2, [[0, 2], [0, 2]]),
    ],
)
def test_every_process_holds_the_same_parameters(tmp_path, mesh, batch, rows):
    """After every step the parameter replicas the two processes hold are identical and equal
    one 8-device process's (a batch laid out per process instead of from the mesh would train
    each process on its own rows)."""
    worker = ROOT / "tests/hax_jax/multiprocess_worker.py"
    runs = {}
    for processes in (2, 1):
        out = tmp_path / str(processes)
        out.mkdir()
        args = [str(out), "3", *TINY, *mesh.split(), f"data.batch_size={batch}", f"workdir={out}"]
        for rc, err in _launch(worker, args, processes, out / "logs"):
            assert rc == 0, err[-3000:]
        runs[processes] = [
            json.loads((out / f"checksums-{i}.json").read_text()) for i in range(processes)
        ]
    assert [r["rows"] for r in runs[2]] == rows
    one = runs[1][0]["steps"]
    for run in runs[2]:
        for step, (mine, single) in enumerate(zip(run["steps"], one, strict=True)):
            assert mine and mine.keys() <= single.keys(), step
            for key in mine:
                np.testing.assert_allclose(mine[key], single[key], rtol=1e-4, err_msg=key)
    for a, b in zip(runs[2][0]["steps"], runs[2][1]["steps"], strict=True):
        shared = a.keys() & b.keys()  # the shards both processes hold agree bit for bit
        assert shared and all(a[key] == b[key] for key in shared)
    assert any(one[0][key] != one[-1][key] for key in one[0])  # the parameters did train


def test_a_mesh_that_leaves_out_a_process_is_refused(tmp_path):
    """Two processes and a one-device mesh: every process stops with one error line naming the
    mesh and the process count, before training."""
    args = [*TINY, "mesh.data=1", f"workdir={tmp_path}"]
    for rc, err in _launch(ROOT / "train.py", args, 2, tmp_path / "logs", timeout=120):
        assert rc != 0
        assert "error: mesh data=1 x seq=1 x tensor=1 = 1 devices, but 8 are available" in err
        assert "over 2 processes" in err


@pytest.mark.parametrize(
    "env, message",
    [
        ({"JAX_PROCESS_ID": "0"}, "so JAX_NUM_PROCESSES must be a non-negative integer, got None"),
        (
            {"JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"},
            "JAX_NUM_PROCESSES must be a non-negative integer, got 'two'",
        ),
        (
            {"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"},
            "JAX_PROCESS_ID=2 must be below JAX_NUM_PROCESSES=2",
        ),
    ],
)
def test_bad_launch_variables_stop_with_one_error_line(tmp_path, env, message):
    """train.py started with JAX_COORDINATOR_ADDRESS but a missing or bad count / id prints one
    error line naming the variable and its value, before connecting to anything."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *TINY, f"workdir={tmp_path}"],
        env={**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COORDINATOR_ADDRESS": "127.0.0.1:1", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = run.stderr.strip().splitlines()
    assert run.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: "), lines
    assert message in lines[0]


def test_a_batch_that_data_does_not_divide_is_refused(tmp_path):
    """One process, 8 devices: data.batch_size=6 over mesh.data=4 stops naming both."""
    args = [*TINY, "mesh.data=4", "data.batch_size=6", f"workdir={tmp_path}"]
    ((rc, err),) = _launch(ROOT / "train.py", args, 1, tmp_path / "logs", timeout=120)
    assert rc != 0
    assert "error: data.batch_size=6 must be a multiple of mesh.data=4" in err
