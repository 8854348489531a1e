"""The longest row (or the largest batch) one training step fits: train.py's step at growing
sizes until one fails.

    python bench/longest_sequence.py --case lm_mamba2_130m_32k [--lengths 65536,131072,...]
        [--set mesh.data=1 mesh.seq=2] [--timeout 240]
    python bench/longest_sequence.py --case lm_mamba2_2_7b --key data.batch_size --lengths 8,16,32

Each size runs in its own process (`bench/train_throughput.py --no-e2e --steps 2 --set
KEY=L ...`, KEY data.seq_len unless --key says): an out-of-memory error leaves the next attempt a
clean device and its peak memory is that size's alone. Stops at the first size that does not
compile and run (out of memory, an error, or past --timeout seconds) and prints a markdown table:
size, step ms, tokens/s, peak GiB per device, or why it failed.
"""

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT))

from bench import timing  # noqa: E402

DEFAULT_LENGTHS = ",".join(str(2**k) for k in range(16, 21))  # 64K ... 1M
OUT_OF_MEMORY = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory")


def attempt(case: str, key: str, length: int, overrides: list[str], timeout: float) -> dict:
    """One step at `key`=`length` in a fresh process: its result row, or why it failed."""
    command = [
        sys.executable,
        str(ROOT / "bench/train_throughput.py"),
        "--cases",
        case,
        "--no-e2e",
        "--steps",
        "2",
        "--set",
        f"{key}={length}",
        *overrides,
    ]
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        # Whether it was still compiling: train_throughput prints when the first step is done.
        out = err.stdout.decode() if isinstance(err.stdout, bytes) else err.stdout or ""
        stage = (
            "after the first step" if "compiled and ran" in out else "before the first step ended"
        )
        return {"length": length, "failed": f"past {timeout:.0f} s, {stage}"}
    rows = [line for line in run.stdout.splitlines() if line.startswith(f"| {case} |")]
    if run.returncode == 0 and rows:
        cells = [cell.strip() for cell in rows[0].strip("|").split("|")]
        return {
            "length": length,
            "step_ms": cells[4],
            "tokens_per_s": cells[6],
            "peak_gib": cells[9],
        }
    log = run.stdout + run.stderr
    why = "out of memory" if any(s in log for s in OUT_OF_MEMORY) else "error"
    last = [line for line in log.splitlines() if line.strip()][-1:] or [""]
    return {"length": length, "failed": f"{why} (rc {run.returncode}): {last[0][:160]}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", required=True, help="a case of bench/train_throughput.py")
    parser.add_argument("--key", default="data.seq_len", help="the config key grown")
    parser.add_argument("--lengths", default=DEFAULT_LENGTHS, help="its values, ascending")
    parser.add_argument("--set", nargs="*", default=[], help="config overrides (e.g. a mesh)")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per attempt")
    args = parser.parse_args()
    lengths = timing.ascending_ints(args.lengths, "--lengths")
    from bench.train_cases import CASES  # jax and the library: only once the flags parse

    # else every attempt would fail and read as "did not fit"
    timing.known_names(parser, "--case", [args.case], CASES)
    print(
        f"\n{args.case} {' '.join(args.set)}\n\n| {args.key} | step ms | tokens/s | peak GiB "
        "per device |\n| ---: | ---: | ---: | --- |",
        flush=True,
    )
    for length in lengths:
        r = attempt(args.case, args.key, length, args.set, args.timeout)
        if "failed" in r:
            print(f"| {length:,} | | | did not fit: {r['failed']} |", flush=True)
            break
        print(
            f"| {length:,} | {r['step_ms']} | {r['tokens_per_s']} | {r['peak_gib']} |", flush=True
        )


if __name__ == "__main__":
    main()
