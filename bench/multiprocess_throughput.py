"""End-to-end training throughput of train.py launched as the README says: one process per GPU.

    python bench/multiprocess_throughput.py --case lm_mamba2_130m --processes 2 [--steps 20]
        [--windows 2] [--set mesh.data=2 data.batch_size=16]

Starts `--processes` train.py processes on this host, process i seeing GPU i alone, with
JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID as in the README; they train
(--windows + 1) x --steps steps on fresh batches of a case of bench/train_throughput.py. Reports
process 0's tokens/s (metrics.jsonl, a window every --steps steps; the first, which compiles, left
out): the mean, the median, then each window's. `--processes 1`
runs one train.py over every visible GPU with the same arguments: the one-process baseline.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT))

from bench.train_cases import CASES, case_argv  # noqa: E402


def free_port() -> int:
    """A TCP port nobody listens on now, for the coordinator."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(
    case: str, processes: int, steps: int, windows: int, extra: list[str], scratch: Path
) -> list[float]:
    """Process 0's tokens/s in each of `windows` windows after the first."""
    workdir = scratch / f"{case}_{processes}p"
    n = (windows + 1) * steps
    argv = [
        *case_argv(case, extra, scratch),
        f"workdir={workdir}",
        f"train.num_steps={n}",
        f"train.log_every={steps}",
        f"train.eval_every={n}",
        f"train.checkpoint_every={n}",
        "data.eval_batches=1",
    ]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    if processes > 1:
        env |= {
            "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}",
            "JAX_NUM_PROCESSES": str(processes),
        }
    procs = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "train.py"), *argv],
            env=env
            if processes == 1
            else env | {"JAX_PROCESS_ID": str(i), "CUDA_VISIBLE_DEVICES": str(i)},
        )
        for i in range(processes)
    ]
    try:
        codes = [p.wait() for p in procs]
    finally:  # interrupted (or one failed): none is left holding a GPU
        for p in procs:
            p.kill()
    if any(codes):
        raise SystemExit(f"error: train.py exited with {codes} for {case} on {processes} processes")
    lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [m["tokens_per_s"] for m in lines if "tokens_per_s" in m][1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", required=True, choices=sorted(CASES))
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="steps a window")
    parser.add_argument("--windows", type=int, default=2, help="windows timed after the first")
    parser.add_argument("--set", nargs="*", default=[], help="config overrides (e.g. the mesh)")
    args = parser.parse_args()
    for name in ("processes", "steps", "windows"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    with tempfile.TemporaryDirectory() as scratch:
        windows = run(args.case, args.processes, args.steps, args.windows, args.set, Path(scratch))
    each = ", ".join(f"{w:,.0f}" for w in windows)
    mean, median = np.mean(windows), np.median(windows)
    print(
        f"| {args.case} | `{' '.join(args.set)}` | {args.processes} | {mean:,.0f} | "
        f"{median:,.0f} | {each} |"
    )


if __name__ == "__main__":
    main()
