"""Training throughput of train.py's jitted step: steps/s and tokens/s on the current device.

    python bench/train_throughput.py [--cases jr_hax,lm_hax_130m] [--steps 20] [--write
    BENCHMARKS.md]
        [--set mesh.data=1 mesh.seq=2 ...] [--warmup N]

Per case: train.Trainer builds the state and data exactly as `python train.py` would; one batch
is fetched, the step is compiled and run once, --warmup steps (default 2) run untimed, then --steps
steps run back to back on that batch (pure step time, data loading excluded), timed to the last
result. The untimed steps keep one-off costs of the first calls out of the mean (the warm-up line
prints their time). As in train.py's loop, the objects alive after the first step are frozen out
of Python's garbage collector (`hax_jax.heap`): before, one full collection of 0.36 s fell inside
the timed steps of HAX-Mamba-2 130M at 1 x 65536 on seq=2 (2026-11-27, 2 x H200); the lines after
the warm-up and the timed steps count such collections. `e2e` is train.py's own tokens/s (its
metrics.jsonl) over a short real run with fresh batches every step, data generation and host
transfer included. `--set` applies config overrides to every case (e.g. a mesh); `peak GiB` is
the largest peak_bytes_in_use of the mesh's devices since the process started (run one case per
process to read it per case). `--collectives` lists the collectives of the compiled step by kind:
count and bytes moved per step.
"""

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT))

import train  # noqa: E402
from bench import timing  # noqa: E402
from bench.train_cases import CASES, case_argv  # noqa: E402
from hax_jax import heap  # noqa: E402
from hax_jax.metrics import device_memory  # noqa: E402
from pallas_kernels.backend import keep_custom_calls_out_of_cuda_graphs  # noqa: E402


def measure(
    name,
    steps,
    scratch: Path,
    e2e=True,
    extra=(),
    profile=0,
    collectives=False,
    hlo_dir="",
    warmup=2,
) -> dict:
    """Pure-step and end-to-end throughput of one case, with `extra` overrides; `profile` > 0
    prints that many of GPU 0's costliest kernels in a step; `collectives` prints the compiled
    step's collectives; `hlo_dir` receives the compiled step's optimized HLO (<case>.hlo.txt);
    `warmup` steps run untimed after the first (under JAX_ENABLE_PGLE: its profiled runs and the
    recompile with their profile)."""
    argv = case_argv(name, extra, scratch)
    cfg = train.resolve_config([*argv, f"workdir={scratch / name}"])
    workdir = Path(cfg.workdir)
    workdir.mkdir(parents=True)
    mesh = train.sharding.make_mesh(cfg.mesh)
    with jax.set_mesh(mesh), heap.frozen_after_compile() as freeze:
        trainer = train.Trainer(cfg, workdir, mesh)
        batch = trainer.batch(next(trainer.iterator))
        state = trainer.state
        # The compile counts in "compile s" also where it is done ahead for the HLO.
        start = time.perf_counter()
        if collectives or hlo_dir:
            compiled = trainer.step_fn.lower(state, batch).compile()
            hlo = compiled.as_text()
        ahead_s = time.perf_counter() - start
        if hlo_dir:
            Path(hlo_dir).mkdir(parents=True, exist_ok=True)
            (Path(hlo_dir) / f"{name}.hlo.txt").write_text(hlo)
        if collectives:
            timing.print_compiled_account(name, extra, compiled, hlo)
        start = time.perf_counter()
        state, metrics = trainer.step_fn(state, batch)
        jax.block_until_ready(metrics)
        compile_s = ahead_s + time.perf_counter() - start
        print(f"{name}: compiled and ran the first step in {compile_s:.1f} s", flush=True)
        freeze()  # as train.py's loop does after the first step
        if warmup:
            start = time.perf_counter()
            with timing.full_collections() as pauses:
                for _ in range(warmup):
                    state, metrics = trainer.step_fn(state, batch)
                jax.block_until_ready(metrics)
            took = time.perf_counter() - start
            each = 1e3 * took / warmup
            print(
                f"{name}: {warmup} warm-up steps in {took:.2f} s ({each:.1f} ms a step); "
                f"{_collections(pauses)}"
            )
        start = time.perf_counter()
        dispatched, returned = [], []
        with timing.full_collections() as pauses:
            for _ in range(steps):
                state, metrics = trainer.step_fn(state, batch)
                dispatched.append(metrics)
                returned.append(time.perf_counter())
            # Each step's end, waited for in order after all were dispatched. Where a step's call
            # itself blocks until earlier steps finish (seen on the GPUs), the calls' returns are
            # what spreads out; either way one slow step, or a slow start, shows beside the mean.
            ends = []
            for step_metrics in dispatched:
                jax.block_until_ready(step_metrics)
                ends.append(time.perf_counter())
        step_s = (ends[-1] - start) / steps

        def apart(times):
            return ", ".join(f"{1e3 * g:.1f}" for g in np.diff([start, *times]))

        print(
            f"{name}: step calls returned {apart(returned)} ms apart, the steps ended "
            f"{apart(ends)} ms apart (each first from the first call); {_collections(pauses)}",
            flush=True,
        )
        rows, length = batch["inputs"].shape
        if profile:
            held = [state]

            def one_step():
                held[0], step_metrics = trainer.step_fn(held[0], batch)
                return step_metrics

            timing.print_step_profile(name, one_step, profile)
        peak_gib = device_memory().get("peak_gib", 0.0)  # every device of this process
    result = {
        "case": name,
        "config": " ".join([*CASES[name], *extra]),
        "mesh": " x ".join(f"{k}={v}" for k, v in mesh.shape.items()),
        "peak_gib": peak_gib,
        "batch": f"{rows} x {length}",
        "compile_s": compile_s,
        "step_ms": 1e3 * step_s,
        "steps_per_s": 1 / step_s,
        "tokens_per_s": rows * length / step_s,
        "e2e_tokens_per_s": float("nan"),
        "loss": float(metrics["loss"]),
    }
    if not e2e:
        return result
    e2e_dir = scratch / f"{name}_e2e"
    n = 3 * steps
    train.main(
        [
            *argv,
            f"workdir={e2e_dir}",
            f"train.num_steps={n}",
            f"train.log_every={steps}",
            f"train.eval_every={n}",
            "data.eval_batches=1",
        ]
    )
    lines = [json.loads(x) for x in (e2e_dir / "metrics.jsonl").read_text().splitlines()]
    windows = [m["tokens_per_s"] for m in lines if "tokens_per_s" in m][1:]  # 1st compiles
    result["e2e_tokens_per_s"] = float(np.mean(windows)) if windows else float("nan")
    return result


def _collections(pauses: list[float]) -> str:
    """The full garbage collections of a stretch of steps, for the log."""
    listed = ", ".join(f"{1e3 * p:.1f}" for p in pauses)
    return f"{len(pauses)} full Python garbage collections" + (f" ({listed} ms)" if pauses else "")


def main() -> None:
    """Runs the cases, prints a markdown table, optionally appends it to a file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--write", default="")
    parser.add_argument("--no-e2e", action="store_true", help="time the jitted step only")
    parser.add_argument("--set", nargs="*", default=[], help="config overrides for every case")
    parser.add_argument("--profile", type=int, default=0, help="print this many top GPU kernels")
    parser.add_argument("--collectives", action="store_true", help="list the step's collectives")
    parser.add_argument("--hlo-dir", default="", help="write each step's optimized HLO here")
    parser.add_argument(
        "--warmup", type=int, default=2, help="untimed steps after the first (one-off costs; PGLE)"
    )
    args = parser.parse_args()
    timing.check_sizes(parser, args, zero_ok=("warmup", "profile"))
    cases = timing.known_names(parser, "--cases", args.cases.split(","), CASES)
    if args.hlo_dir:  # before any compile, not after the first case's
        timing.make_dir(parser, "--hlo-dir", args.hlo_dir)
    device = jax.devices()[0]
    header = (
        f"\n### train step throughput: {device.device_kind} ({device.platform}), "
        f"jax {jax.__version__}, {platform.node()}\n\n"
        "| case | config | batch | compile s | step ms | steps/s | tokens/s "
        "| e2e tokens/s | mesh | peak GiB |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
    )
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in cases:
            r = measure(
                name,
                args.steps,
                Path(scratch),
                e2e=not args.no_e2e,
                extra=args.set,
                profile=args.profile,
                collectives=args.collectives,
                hlo_dir=args.hlo_dir,
                warmup=args.warmup,
            )
            rows.append(
                f"| {r['case']} | `{r['config']}` | {r['batch']} | {r['compile_s']:.1f} | "
                f"{r['step_ms']:.2f} | {r['steps_per_s']:.2f} | {r['tokens_per_s']:,.0f} | "
                f"{r['e2e_tokens_per_s']:,.0f} | {r['mesh']} | {r['peak_gib']:.1f} |\n"
            )
            print(rows[-1], end="", flush=True)
    table = header + "".join(rows)
    print(table)
    if args.write:
        with open(args.write, "a") as f:
            f.write(table)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    keep_custom_calls_out_of_cuda_graphs()  # as train.py does
    main()
