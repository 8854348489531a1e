"""hax_jax.sweep: runs trained and evaluated as subprocesses, tabulated from their eval.py outputs;
a rerun skips finished runs and resumes unfinished ones; bad input is refused before any run."""

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tiny_runs import TINY_JOINT_RECALL, subprocess_xla_flags

from hax_jax import config as config_lib
from hax_jax import sweep
from hax_jax.data import pipeline, split_cache

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs/joint_recall.py")
# Seconds-long runs: joint recall of up to 2 x 2 tables (22 positions), 16 valid and test examples.
TINY = [
    *TINY_JOINT_RECALL,
    "model.mamba2.chunk_size=16",
    "train.log_every=1",
    "train.eval_every=2",
    "optim.warmup_steps=1",
]
# TINY_JOINT_RECALL's 8 rows of 21 inputs: 2 parts of 2 contexts x (1 + 2 x 2 key-value tokens),
# bos, sep, less the last token (it is only a label).
TOKENS_PER_STEP = 8 * (2 * 2 * (1 + 2 * 2) + 2 - 1)


@pytest.fixture
def cpu_runs(monkeypatch):
    """The runs' environment: one CPU device each (not the suite's 8 simulated ones), no GPU."""
    monkeypatch.setenv("XLA_FLAGS", subprocess_xla_flags())
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def _test_result(run: Path, step: int) -> dict:
    """What eval.py wrote for the run's test split at `step`."""
    result = json.loads((run / f"eval_test_step{step}.json").read_text())["joint_recall"]
    assert result["split"] == "test" and result["examples"] == 16
    return result


def _logs(out: Path) -> dict[str, str]:
    """Every run's train.log and eval.log (one header line per launch)."""
    return {str(p.relative_to(out)): p.read_text() for p in sorted(out.glob("*/*.log"))}


def _checkpoint_identity(run: Path, step: int) -> tuple[int, int]:
    """(inode, mtime) of a checkpoint directory: a rewritten checkpoint changes them."""
    stat = (run / "checkpoints" / str(step)).stat()
    return stat.st_ino, stat.st_mtime_ns


def test_sweep_trains_tabulates_skips_and_resumes(tmp_path, cpu_runs):
    out = tmp_path / "joint_recall"
    argv = [CONFIG, "--cells", "mamba2,none", "--jobs", "2", "--out", str(out), *TINY]
    summary = sweep.main([*argv, "--seeds", "0,1", "train.num_steps=2"])

    runs = {f"mamba2,none-s{seed}": out / f"mamba2,none-s{seed}" for seed in (0, 1)}
    assert list(summary["runs"]) == list(runs)
    results = {name: _test_result(run, 2) for name, run in runs.items()}
    for seed, (name, run) in enumerate(runs.items()):
        assert summary["runs"][name] == {
            "cell": "mamba2,none",
            "seed": seed,
            "path": run.name,
            "steps": 2,
            "tokens": 2 * TOKENS_PER_STEP,
            "status": "done",
            "best_step": 2,
            "test_accuracy": results[name]["accuracy"],
            "test_loss": results[name]["loss"],
            "test_examples": 16,
        }
        assert json.loads((run / "config.json").read_text())["seed"] == seed
    assert results["mamba2,none-s0"]["loss"] != results["mamba2,none-s1"]["loss"]  # two models
    assert json.loads((out / "summary.json").read_text()) == summary

    accuracies = [r["accuracy"] for r in results.values()]
    mean, std = statistics.mean(accuracies), statistics.stdev(accuracies)
    assert summary["cells"]["mamba2,none"]["mean"] == pytest.approx(mean)
    per_seed = ", ".join(f"{100 * a:.1f}" for a in accuracies)
    row = f"| mamba2,none | {100 * mean:.1f} ± {100 * std:.1f} | 36.6 | 2 | {per_seed} | 2 |"
    assert row in (out / "table.md").read_text().splitlines()
    assert (out / "curves" / "mamba2,none.png").read_bytes()[:4] == b"\x89PNG"

    # Finished runs are skipped: no train.py or eval.py starts again.
    logs = _logs(out)
    sweep.main([*argv, "--seeds", "0,1", "train.num_steps=2", "--no-plots"])
    assert _logs(out) == logs

    # More steps: seed 0 continues from its step-2 checkpoint (kept as it was, its logged steps
    # too) to step 4 and is evaluated again; seed 1 is not part of this command.
    run = runs["mamba2,none-s0"]
    step_2 = _checkpoint_identity(run, 2)
    metrics = sweep.read_metrics(run)
    summary = sweep.main([*argv, "--seeds", "0", "train.num_steps=4", "--no-plots"])
    assert _checkpoint_identity(run, 2) == step_2
    resumed = sweep.read_metrics(run)
    assert resumed[: len(metrics)] == metrics
    assert [m["step"] for m in resumed if "loss" in m] == [1, 2, 3, 4]
    assert (run / "train.log").read_text().count("\n# ") == 1  # a second launch
    assert summary["runs"]["mamba2,none-s0"]["test_accuracy"] == _test_result(run, 4)["accuracy"]
    assert summary["runs"]["mamba2,none-s0"]["steps"] == 4
    assert list(summary["runs"]) == ["mamba2,none-s0"]

    # Trained but not evaluated: only eval.py runs again, whether its output is missing (killed
    # before writing) or holds no result for the task (an eval.py stopped by a sitting's time
    # limit on an H200 had left "{}" there, which the sweep then took for done).
    for leftover in (None, "{}\n"):
        result_file = run / "eval_test_step4.json"
        result_file.unlink()
        if leftover is not None:
            result_file.write_text(leftover)
        logs = _logs(out)
        summary = sweep.main([*argv, "--seeds", "0", "train.num_steps=4", "--no-plots"])
        now = _logs(out)
        assert now["mamba2,none-s0/train.log"] == logs["mamba2,none-s0/train.log"]
        assert (
            now["mamba2,none-s0/eval.log"].count("\n# ")
            == logs["mamba2,none-s0/eval.log"].count("\n# ") + 1
        )
        result = _test_result(run, 4)
        assert summary["runs"]["mamba2,none-s0"]["test_accuracy"] == result["accuracy"]

    # A run as committed to results/ (no checkpoints/): tabulated from its test result with nothing
    # started; more steps are refused (train.py from step 0 would overwrite best/), not retrained.
    shutil.rmtree(run / "checkpoints")
    logs = _logs(out)
    summary = sweep.main([*argv, "--seeds", "0", "train.num_steps=4", "--no-plots"])
    assert _logs(out) == logs
    entry = summary["runs"]["mamba2,none-s0"]
    assert (entry["status"], entry["steps"], entry["best_step"]) == ("done", 4, 4)
    assert entry["test_accuracy"] == result["accuracy"]
    with pytest.raises(RuntimeError, match="tested at step 4, no checkpoint to continue from"):
        sweep.main([*argv, "--seeds", "0", "train.num_steps=6", "--no-plots"])
    assert _logs(out) == logs


def test_draw_splits_fills_the_cache_and_starts_no_run(tmp_path, monkeypatch):
    """--draw-splits: the cells' valid and test splits land in $HAX_JAX_CACHE, one file per split
    the cells share; nothing is trained or written beside the runs."""
    cache, out = tmp_path / "cache", tmp_path / "runs"
    monkeypatch.setenv("HAX_JAX_CACHE", str(cache))
    argv = [CONFIG, "--cells", "mamba2,hax mamba,none", "--out", str(out), *TINY]
    assert sweep.main([*argv, "--draw-splits"]) == {
        "splits": ["mamba,none valid", "mamba,none test", "mamba2,hax valid", "mamba2,hax test"]
    }
    files = sorted(cache.glob("*.npz"))
    assert [f.name.split("-")[1] for f in files] == ["test", "valid"]
    for file in files:
        assert np.load(file)["tokens"].shape[0] == 16  # TINY's valid_size, test's too
    assert not out.exists()
    # What a run reads is what it would have drawn: the valid split's first example, uncached.
    cfg = config_lib.apply_overrides(config_lib.load_config_file(f"{CONFIG}:mamba2,hax"), TINY)
    cached = pipeline.make_source(cfg, "valid", out)[0]
    monkeypatch.setattr(split_cache, "directory", lambda: None)
    drawn = pipeline.make_source(cfg, "valid", out)[0]
    assert all(np.array_equal(cached[k], drawn[k]) for k in drawn)


def test_cells_are_names_or_patterns_in_the_config_order(tmp_path):
    args = sweep.parse_args([CONFIG, "--cells", "samba mamba2,*", "--cells", "mamba,hax"])
    args.out = str(tmp_path)
    runs, paper = sweep.plan(args)
    cells = [f"mamba2,{v}" for v in ("none", "d", "sw", "sw+d", "a", "lsh", "ks", "hax", "double")]
    assert [r.cell for r in runs] == ["mamba,hax", *cells, "samba"]
    assert runs[0].path == tmp_path / "mamba,hax-s0" and runs[0].num_steps == 1000
    assert paper["mamba2,hax"] == 74.3 and paper["samba"] == 6.3


@pytest.mark.parametrize(
    "argv, error, message",
    [
        (
            ["--cells", "mamba3,hax"],
            ValueError,
            r"unknown cell 'mamba3,hax'; the config's cells: mamba,none, mamba,d, .*, samba$",
        ),
        (["--seeds", "0,x"], ValueError, r"--seeds takes non-negative integers .*got '0,x'"),
        (["--seeds", "1,1"], ValueError, "--seeds names a seed twice: '1,1'"),
        (["--jobs", "0"], ValueError, "--jobs must be at least 1, got 0"),
        (["seed=3"], ValueError, r"the sweep sets workdir and seed .*got 'seed=3'"),
        (["train.num_stepz=3"], ValueError, "unknown config key 'train.num_stepz'"),
    ],
)
def test_bad_input_is_refused_before_any_run(tmp_path, argv, error, message):
    with pytest.raises(error, match=message):
        sweep.main([CONFIG, "--out", str(tmp_path), *argv])
    assert not list(tmp_path.iterdir())


def test_bad_config_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config file '.*nope\.py' does not exist"):
        sweep.main([str(tmp_path / "nope.py")])
    with pytest.raises(ValueError, match=r"main\.py' defines no VARIANTS"):
        sweep.main([str(ROOT / "configs/main.py")])
    with pytest.raises(ValueError, match="give the config file alone"):
        sweep.main([f"{CONFIG}:mamba,hax"])


def test_plots_without_matplotlib_are_refused_up_front(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # find_spec then finds none
    with pytest.raises(ValueError, match=r"plots need matplotlib: pip install 'hax-jax\[sweep\]'"):
        sweep.main([CONFIG, "--out", str(tmp_path)])


def test_cli_prints_one_error_line():
    proc = subprocess.run(
        [sys.executable, "-m", "hax_jax.sweep", CONFIG, "--seeds", "a"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"},
        check=False,
    )
    assert proc.returncode == 1
    assert (
        proc.stderr == "error: --seeds takes non-negative integers separated by commas, got 'a'\n"
    )


def test_runs_are_pinned_to_the_gpus_and_share_their_memory(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    gpus = sweep.visible_gpus()
    assert gpus == ["2", "3"]
    envs = [sweep.run_env(slot, gpus, jobs=4) for slot in range(4)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["2", "3", "2", "3"]
    assert {e["JAX_PLATFORMS"] for e in envs} == {"cuda"}  # no silent fall back to the CPU
    assert {e["XLA_PYTHON_CLIENT_MEM_FRACTION"] for e in envs} == {"0.45"}  # two runs a GPU
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in sweep.run_env(1, gpus, jobs=2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert sweep.visible_gpus() == []
    assert sweep.run_env(0, [], jobs=3)["CUDA_VISIBLE_DEVICES"] == ""
    assert "JAX_PLATFORMS" not in sweep.run_env(0, [], jobs=3)
