"""Trains a grid's cells over seeds: `python -m hax_jax.sweep CONFIG [options] [key=value ...]`.

Every (cell, seed) is one train.py run in OUT/<cell>-s<seed> (a workdir eval.py loads), then eval.py
on the test split of its task (joint_recall or mqar) with its best-by-validation parameters. --jobs
runs go at once, as subprocesses: each pinned to one GPU (CUDA_VISIBLE_DEVICES) when there are GPUs,
with an equal share of its memory when runs share one. Rerunning the same command skips finished
runs (a test result at train.num_steps: with its checkpoint, or without, as committed), resumes
the others from their checkpoints (a larger train.num_steps continues where the last sitting
stopped; a run with a test result but no checkpoint is reported, not retrained) and evaluates what
was trained but not yet evaluated. Ctrl-C or SIGTERM makes every running train.py save and stop.

Writes OUT/summary.json (every run: cell, seed, steps, tokens seen, test accuracy, its directory),
OUT/table.md (each cell's test accuracy, mean and standard deviation over seeds, beside the config's
PAPER_ACCURACY) and OUT/curves/<cell>.png (valid accuracy and loss against the step, a line per
seed; needs matplotlib, the `sweep` extra; --no-plots skips them). OUT less its checkpoints/ (which
.gitignore keeps out of results/) is what to commit: eval.py loads each run from its best/. A seed
is the run's `seed=` (parameters, training rng): all seeds of a cell see the same data (data.seed)
and the same test split. The config file lists its cells in VARIANTS (configs/joint_recall.py:
`mamba2,hax`, `samba`, ...). --draw-splits only draws the cells' evaluation splits into
$HAX_JAX_CACHE (hax_jax.data.split_cache), to carry to a machine whose runs should not draw them.
"""

import argparse
import dataclasses
import fnmatch
import importlib.util
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hax_jax import config as config_lib
from hax_jax.data import pipeline, split_cache
from hax_jax.data.pipeline import row_length

ROOT = Path(__file__).resolve().parents[1]  # train.py and eval.py live beside the package
EVAL_TASKS = ("joint_recall", "mqar")
SWEEP_KEYS = ("workdir", "seed")  # set per run by the sweep, never by an override


@dataclasses.dataclass(frozen=True)
class Run:
    """One (cell, seed) of the sweep and what it needs to train and evaluate."""

    cell: str
    seed: int
    path: Path  # the run's workdir
    num_steps: int
    task: str  # the eval.py task of its test split
    eval_batch_size: int
    tokens_per_step: int  # batch rows x row length: the run has seen steps x this tokens

    def result_file(self, step: int) -> Path:
        """eval.py's test-split result for the parameters trained to `step`."""
        return self.path / f"eval_test_step{step}.json"


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line; key=value words are collected as overrides of every run."""
    parser = argparse.ArgumentParser(
        prog="python -m hax_jax.sweep",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("config", help="a config file whose VARIANTS are the cells")
    parser.add_argument(
        "--cells",
        action="append",
        help="cells, space-separated or repeated; shell patterns match (e.g. 'mamba2,*'); "
        "default: every cell",
    )
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    parser.add_argument(
        "--jobs", type=int, default=None, help="runs at once (default: one per visible GPU, else 1)"
    )
    parser.add_argument("--out", default="", help="output directory (default results/<config>)")
    parser.add_argument("--no-plots", action="store_true", help="skip the learning-curve PNGs")
    parser.add_argument(
        "--draw-splits",
        action="store_true",
        help="only draw the cells' valid and test splits into $HAX_JAX_CACHE (the ones a task "
        "keeps there: joint recall's) and exit; copied to a GPU machine, its runs need not wait",
    )
    args, overrides = parser.parse_known_args(argv)
    unknown = [o for o in overrides if "=" not in o]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = overrides
    return args


def plan(args: argparse.Namespace) -> tuple[list[Run], dict[str, float]]:
    """The runs asked for, every cell's config resolved (bad input fails here, before any run), and
    the paper's accuracy (%) of each cell that the config file gives in PAPER_ACCURACY."""
    if ".py:" in args.config:
        raise ValueError(f"give the config file alone ({args.config!r}); choose cells with --cells")
    module = config_lib.load_config_module(args.config)
    variants = getattr(module, "VARIANTS", None)
    if not variants:
        raise ValueError(f"config file {args.config!r} defines no VARIANTS (the cells of a sweep)")
    cells = _cells(args.cells, variants)
    seeds = _seeds(args.seeds)
    for override in args.overrides:
        if override.partition("=")[0] in SWEEP_KEYS:
            raise ValueError(
                f"the sweep sets workdir and seed for each run (--out, --seeds); got {override!r}"
            )
    out = Path(args.out or Path("results") / Path(args.config).stem).absolute()
    runs = []
    for cell in cells:
        cfg = config_lib.apply_overrides(module.get_config(cell), args.overrides)
        if cfg.data.task not in EVAL_TASKS:
            raise ValueError(
                f"the sweep evaluates {' or '.join(EVAL_TASKS)}; cell {cell!r} trains "
                f"data.task={cfg.data.task!r}"
            )
        task, batch_size, steps = cfg.data.task, cfg.data.batch_size, cfg.train.num_steps
        tokens = batch_size * row_length(cfg)
        for seed in seeds:
            runs.append(Run(cell, seed, out / f"{cell}-s{seed}", steps, task, batch_size, tokens))
    return runs, getattr(module, "PAPER_ACCURACY", {})


def _cells(given: list[str] | None, variants: tuple[str, ...]) -> list[str]:
    """The cells named (space-separated words, shell patterns), in the config's order."""
    if not given:
        return list(variants)
    words = [w for value in given for w in value.split()]
    for word in words:
        if not fnmatch.filter(variants, word):
            raise ValueError(f"unknown cell {word!r}; the config's cells: {', '.join(variants)}")
    return [v for v in variants if any(fnmatch.fnmatchcase(v, w) for w in words)]


def _seeds(text: str) -> list[int]:
    """--seeds as distinct non-negative ints."""
    words = [w.strip() for w in text.split(",")]
    for word in words:
        if not word.isdigit():
            raise ValueError(
                f"--seeds takes non-negative integers separated by commas, got {text!r}"
            )
    seeds = [int(w) for w in words]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds names a seed twice: {text!r}")
    return seeds


# ----------------------------------------------------------------------------- running


def visible_gpus() -> list[str]:
    """The GPUs runs are pinned to: CUDA_VISIBLE_DEVICES's entries if set, else nvidia-smi's."""
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        ids = os.environ["CUDA_VISIBLE_DEVICES"].split(",")
        return [i.strip() for i in ids if i.strip() and i.strip() != "-1"]
    if shutil.which("nvidia-smi") is None:
        return []
    query = ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"]
    listed = subprocess.run(query, capture_output=True, text=True, check=False)
    return listed.stdout.split() if listed.returncode == 0 else []


def run_env(slot: int, gpus: list[str], jobs: int) -> dict[str, str]:
    """The environment of a run in job slot `slot`: its GPU, and its share of the GPU's memory when
    runs share one (JAX would otherwise take 75% of it for each). A run pinned to a GPU it cannot
    open fails instead of training on the CPU, where JAX falls back with a warning unless told its
    platform (under CUDA MPS, runs pinned to a GPU the daemon was not given did); a JAX_PLATFORMS
    already set is kept."""
    env = dict(os.environ)
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = gpus[slot % len(gpus)]
        env.setdefault("JAX_PLATFORMS", "cuda")
        per_gpu = -(-jobs // len(gpus))
        if per_gpu > 1:
            env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 / per_gpu:.2f}")
    return env


def latest_step(workdir: Path) -> int | None:
    """The step of the run's newest finished checkpoint (orbax renames a step's directory into place
    once written), or None."""
    return _newest_step(workdir / "checkpoints")


def tested_step(run: Run) -> int | None:
    """The newest step with a test result of the run's task, or None."""
    prefix = "eval_test_step"
    tested = (p.stem.removeprefix(prefix) for p in run.path.glob(f"{prefix}*.json"))
    return max((int(s) for s in tested if s.isdigit() and _evaluated(run, int(s))), default=None)


def trained_step(run: Run) -> int | None:
    """The step the run is trained to: its newest finished checkpoint, else its newest tested step
    (a committed run: results/ keeps best/ and the results, not the checkpoints)."""
    step = latest_step(run.path)
    return tested_step(run) if step is None else step


def _newest_step(directory: Path) -> int | None:
    """The largest all-digit entry of `directory` (not an unfinished orbax step), or None."""
    return max((int(p.name) for p in directory.glob("*") if p.name.isdigit()), default=None)


class Runner:
    """Runs the train / eval subprocesses in job slots; a signal makes the running train.py save."""

    def __init__(self, config: str, overrides: list[str], jobs: int, gpus: list[str]):
        self.config, self.overrides, self.jobs, self.gpus = config, overrides, jobs, gpus
        self.live: set[subprocess.Popen] = set()
        self.lock = threading.Lock()
        self.stopped_by = ""
        self.slots = list(range(jobs))

    def run_all(self, runs: list[Run]) -> dict[Run, str]:
        """Every run's status ("done" or why not), `jobs` at a time."""
        handlers = {s: signal.signal(s, self._stop) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            with ThreadPoolExecutor(self.jobs) as pool:
                statuses = list(pool.map(self._in_slot, runs))
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        return dict(zip(runs, statuses, strict=True))

    def _in_slot(self, run: Run) -> str:
        """Runs `run` in a free job slot (so on that slot's GPU)."""
        with self.lock:
            slot = self.slots.pop()
        try:
            status = self.execute(run, run_env(slot, self.gpus, self.jobs))
        finally:
            with self.lock:
                self.slots.append(slot)
        print(f"{run.path.name}: {status}", flush=True)
        return status

    def execute(self, run: Run, env: dict[str, str]) -> str:
        """Trains the run to num_steps (resuming) unless trained, evaluates it unless evaluated."""
        step = latest_step(run.path)
        if step is None and (tested := tested_step(run)) is not None:
            if tested >= run.num_steps:
                return "done"
            # Training from step 0 would overwrite its best/ and metrics: refused, not restarted.
            return f"tested at step {tested}, no checkpoint to continue from ({run.path})"
        if step is None or step < run.num_steps:
            start = step or 0
            train = [sys.executable, str(ROOT / "train.py"), f"{self.config}:{run.cell}"]
            argv = ["train.progress=false", *self.overrides, f"seed={run.seed}"]
            code = self._call([*train, *argv, f"workdir={run.path}"], run.path / "train.log", env)
            step = latest_step(run.path)
            if code == "stopped":
                return "not started (stopped)"
            if code != 0 or step is None or step < run.num_steps:
                why = f"train.py exited with {code}" if code else f"stopped at step {step}"
                return f"{why} (see {run.path / 'train.log'})"
            print(f"{run.path.name}: trained steps {start + 1}-{step}", flush=True)
        result = run.result_file(step)
        if not _evaluated(run, step):
            evaluate = [sys.executable, str(ROOT / "eval.py"), str(run.path), "--tasks", run.task]
            flags = ["--split", "test", "--batch-size", str(run.eval_batch_size)]
            code = self._call(
                [*evaluate, *flags, "--output", str(result)], run.path / "eval.log", env
            )
            if code == "stopped":
                return "not evaluated (stopped)"
            if code != 0 or not _evaluated(run, step):
                return f"eval.py exited with {code} (see {run.path / 'eval.log'})"
        return "done"

    def _call(self, cmd: list[str], log: Path, env: dict[str, str]) -> int | str:
        """Runs `cmd`, its output appended to `log`; its exit code ("stopped" after a signal)."""
        with self.lock:
            if self.stopped_by:
                return "stopped"
            log.parent.mkdir(parents=True, exist_ok=True)
            with open(log, "a") as out:
                out.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(cmd)}\n")
                out.flush()
                # Its own session: a Ctrl-C reaches the sweep only, which asks train.py to save.
                proc = subprocess.Popen(
                    cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
            self.live.add(proc)
        code = proc.wait()
        with self.lock:
            self.live.discard(proc)
        return code

    def _stop(self, signum, frame) -> None:
        """SIGINT / SIGTERM: no new process starts; running ones get SIGTERM (train.py saves)."""
        with self.lock:
            self.stopped_by = signal.Signals(signum).name
            for proc in self.live:
                proc.send_signal(signal.SIGTERM)


def _evaluated(run: Run, step: int) -> bool:
    """Whether eval.py's output for `step` holds the run's task: a file without it (an eval.py
    stopped before the task finished, e.g. by a sitting's time limit) does not count."""
    path = run.result_file(step)
    if not path.exists():
        return False
    try:
        return run.task in json.loads(path.read_text())
    except json.JSONDecodeError:
        return False


# ----------------------------------------------------------------------------- results


def summarize(runs: list[Run], statuses: dict[Run, str], paper: dict) -> dict:
    """summary.json: every run's test result (read from its eval.py output) and each cell's mean."""
    entries = {}
    for run in runs:
        step = trained_step(run)
        # The path relative to summary.json: the directory is committed and moved as a whole.
        entry = {"cell": run.cell, "seed": run.seed, "path": run.path.name, "steps": step}
        entry["tokens"] = None if step is None else step * run.tokens_per_step
        entry["status"] = statuses[run]
        if statuses[run] == "done":
            result = json.loads(run.result_file(step).read_text())[run.task]
            entry["best_step"] = _newest_step(run.path / "best")  # the parameters eval.py read
            entry["test_accuracy"] = result["accuracy"]
            entry["test_loss"] = result["loss"]
            entry["test_examples"] = result["examples"]
        entries[run.path.name] = entry
    cells = {}
    for cell in dict.fromkeys(run.cell for run in runs):
        done = [e for e in entries.values() if e["cell"] == cell and "test_accuracy" in e]
        accuracies = [e["test_accuracy"] for e in done]
        cells[cell] = {
            "seeds": [e["seed"] for e in done],
            "steps": sorted({e["steps"] for e in done}),
            "test_accuracy": accuracies,
            "mean": statistics.mean(accuracies) if accuracies else None,
            "std": statistics.stdev(accuracies) if len(accuracies) > 1 else None,
            "paper": paper.get(cell),
        }
    return {"runs": entries, "cells": cells}


def table(summary: dict, config: str) -> str:
    """table.md: each cell's test accuracy (%), mean ± std over seeds, beside the paper's."""
    lines = [
        f"Test accuracy (%) of `{config}`: ours (mean ± sample std over seeds), the paper's.",
        "",
        "| cell | ours | paper | seeds | per seed | steps |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for cell, c in summary["cells"].items():
        ours = "–" if c["mean"] is None else f"{100 * c['mean']:.1f}"
        if c["std"] is not None:
            ours += f" ± {100 * c['std']:.1f}"
        paper = "–" if c["paper"] is None else f"{c['paper']:.1f}"
        per_seed = ", ".join(f"{100 * a:.1f}" for a in c["test_accuracy"]) or "–"
        steps = ", ".join(map(str, c["steps"])) or "–"
        lines.append(f"| {cell} | {ours} | {paper} | {len(c['seeds'])} | {per_seed} | {steps} |")
    return "\n".join(lines) + "\n"


def read_metrics(workdir: Path) -> list[dict]:
    """train.py's metrics.jsonl lines (none if it has not written one)."""
    path = workdir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def plot_curves(runs: list[Run], directory: Path) -> list[Path]:
    """One PNG per cell: valid accuracy, and training (solid) / valid (dashed) loss, per seed."""
    from matplotlib.figure import Figure  # the `sweep` extra; no pyplot, so no GUI backend

    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for cell in dict.fromkeys(run.cell for run in runs):
        fig = Figure(figsize=(10, 4), layout="constrained")
        accuracy_ax, loss_ax = fig.subplots(1, 2)
        for i, run in enumerate(r for r in runs if r.cell == cell):
            lines, color = read_metrics(run.path), f"C{i % 10}"
            train = [m for m in lines if "loss" in m]
            valid = [m for m in lines if "valid_accuracy" in m]
            steps = [m["step"] for m in valid]
            label = f"seed {run.seed}"
            accuracy_ax.plot(
                steps, [m["valid_accuracy"] for m in valid], "o-", c=color, label=label
            )
            loss_ax.plot(
                [m["step"] for m in train], [m["loss"] for m in train], c=color, label=label
            )
            loss_ax.plot(steps, [m["valid_loss"] for m in valid], "o--", c=color)
        accuracy_ax.set(title=f"{cell}: valid accuracy", xlabel="step", ylim=(0, 1))
        loss_ax.set(title=f"{cell}: loss (train solid, valid dashed)", xlabel="step")
        accuracy_ax.legend()
        written.append(directory / f"{cell}.png")
        fig.savefig(written[-1], dpi=100)
    return written


# ----------------------------------------------------------------------------- entry points


def draw_splits(args: argparse.Namespace, runs: list[Run]) -> list[str]:
    """Each planned cell's valid and test splits, drawn into split_cache.directory() where its
    task keeps them (cells that share a split draw it once); the names of the splits drawn."""
    module = config_lib.load_config_module(args.config)
    drawn = []
    for cell in dict.fromkeys(run.cell for run in runs):
        cfg = config_lib.apply_overrides(module.get_config(cell), args.overrides)
        for split in ("valid", "test"):
            source = pipeline.make_source(cfg, split, runs[0].path.parent)
            if getattr(source, "cache_dir", None) is not None:
                source[0]  # the first access draws (or reads) the whole split
                drawn.append(f"{cell} {split}")
    names = ", ".join(drawn) or "none"
    print(f"in {split_cache.directory()} (a file per distinct split): {names}")
    return drawn


def main(argv: list[str]) -> dict:
    """Plans, runs (skipping finished runs), writes summary.json, table.md and the curves."""
    args = parse_args(argv)
    runs, paper = plan(args)
    if args.draw_splits:
        return {"splits": draw_splits(args, runs)}
    if not args.no_plots and importlib.util.find_spec("matplotlib") is None:
        raise ValueError(
            "the learning-curve plots need matplotlib: pip install 'hax-jax[sweep]' "
            "(or pass --no-plots)"
        )
    if not (ROOT / "train.py").is_file():
        raise FileNotFoundError(f"no train.py in {ROOT}: the sweep runs from a source checkout")
    gpus = visible_gpus()
    if args.jobs is not None and args.jobs < 1:
        raise ValueError(f"--jobs must be at least 1, got {args.jobs}")
    jobs = args.jobs or max(len(gpus), 1)
    config = str(Path(args.config).absolute())
    print(f"{len(runs)} runs, {jobs} at a time, GPUs: {', '.join(gpus) or 'none'}", flush=True)
    runner = Runner(config, args.overrides, jobs, gpus)
    statuses = runner.run_all(runs)
    summary = {
        "config": args.config,
        "overrides": args.overrides,
        **summarize(runs, statuses, paper),
    }
    out = runs[0].path.parent
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "table.md").write_text(table(summary, args.config))
    if not args.no_plots:
        plot_curves(runs, out / "curves")
    print(table(summary, args.config), end="")
    if runner.stopped_by:
        raise RuntimeError(f"stopped by {runner.stopped_by}; rerun the same command to resume")
    failed = [
        f"{name} ({e['status']})" for name, e in summary["runs"].items() if e["status"] != "done"
    ]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(runs)} runs did not finish: {'; '.join(failed)}")
    return summary


def cli() -> None:
    """`python -m hax_jax.sweep` / `hax-jax-sweep`: one error line, no traceback, on bad input."""
    try:
        main(sys.argv[1:])
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    cli()
