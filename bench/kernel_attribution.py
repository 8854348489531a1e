"""Which source lines a step's GPU time goes to, and where two steps differ.

Reads the optimized HLO (`bench/train_throughput.py --hlo-dir`) and the kernel list of the same
step (`--profile N` lines "  12.345 ms  name"), maps each XLA fusion to the innermost hax_jax /
pallas_kernels frame of its stack metadata (a custom call's kernel keeps its own name), and sums
the milliseconds per line. With two steps (e.g. one GPU and seq=2) it prints, per line, the second
step's time minus the first's scaled by --scale (0.5: half of one GPU's work per device):

    python bench/kernel_attribution.py ONE.hlo.txt ONE.log SEQ2.hlo.txt SEQ2.log --scale 0.5

With --line PATTERN it lists instead, per step, the kernels behind the source lines containing
PATTERN (e.g. conv.py:1), to read their fusions in the HLO.
"""

import argparse
import collections
import re

FRAME_SECTIONS = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
OURS = ("hax_jax/", "pallas_kernels/")


def profiler_name(instruction: str) -> str:
    """An HLO instruction's name as the profiler writes its kernel ("fusion.12" -> "fusion_12")."""
    return re.sub(r"[.\-]", "_", instruction)


def hlo_sources(path: str) -> dict[str, str]:
    """{instruction name as the profiler writes it: innermost hax_jax / pallas_kernels frame
    ("file:line:function"), or "op:<jax primitive>" where the stack has none of ours}."""
    tables = {name: {} for name in FRAME_SECTIONS}
    metadata = {}
    section = None
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if line in FRAME_SECTIONS:
                section = line
                continue
            if section and line[:1].isdigit():
                key, rest = line.split(" ", 1)
                tables[section][int(key)] = rest
                continue
            section = None
            m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = .*?metadata=\{([^}]*)\}", line)
            if m:
                op = re.search(r'op_name="([^"]*)"', m[2])
                frame = re.search(r"stack_frame_id=(\d+)", m[2])
                name = profiler_name(m[1])
                metadata[name] = (op[1] if op else "", int(frame[1]) if frame else 0)
    files = {k: v.strip('"') for k, v in tables["FileNames"].items()}
    functions = {k: v.strip('"') for k, v in tables["FunctionNames"].items()}

    def ours(frame_id: int) -> str:
        seen = set()
        while frame_id and frame_id not in seen:
            seen.add(frame_id)
            frame = tables["StackFrames"][frame_id]
            location_id, parent = (int(x) for x in re.findall(r"=(\d+)", frame))
            location = tables["FileLocations"][location_id]
            file_id, function_id, line = (int(x) for x in re.findall(r"=(\d+)", location)[:3])
            file = files[file_id]
            if any(part in file for part in OURS):
                tail = file[max(file.find(part) for part in OURS if part in file) :]
                return f"{tail}:{line}:{functions[function_id]}"
            frame_id = parent
        return ""

    return {
        name: ours(frame) or ("op:" + re.sub(r"\.\d+", "", op.split("/")[-1]) if op else "?")
        for name, (op, frame) in metadata.items()
    }


def kernel_times(path: str) -> dict[str, float]:
    """{kernel name: ms per step} from a `--profile` listing."""
    times = collections.defaultdict(float)
    for line in open(path):
        m = re.match(r"\s+([\d.]+) ms  (\S.*)$", line)
        if m:
            times[m[2]] += float(m[1])
    return times


def read_step(hlo: str, log: str) -> tuple[dict[str, str], dict[str, float]]:
    """(`hlo_sources`, `kernel_times`) of one step; SystemExit naming a file that cannot be read
    or holds no kernel list / no stack metadata."""
    try:
        sources, times = hlo_sources(hlo), kernel_times(log)
    except OSError as e:
        raise SystemExit(f"error: cannot read {e.filename}: {e.strerror}") from None
    if not times:
        raise SystemExit(f"error: {log} lists no kernels (run train_throughput.py --profile N)")
    if not sources:
        raise SystemExit(f"error: {hlo} has no instructions with metadata (not an optimized HLO?)")
    return sources, times


def by_source(hlo: str, log: str) -> dict[str, float]:
    """{source line (or "kernel:<name>"): ms per step}."""
    sources, times = read_step(hlo, log)
    out = collections.defaultdict(float)
    for kernel, ms in times.items():
        out[sources.get(kernel, f"kernel:{kernel}")] += ms
    return out


def kernels_of_line(hlo: str, log: str, pattern: str) -> list[tuple[float, str, str]]:
    """(ms per step, kernel, source) of the kernels whose source line contains `pattern`, the
    slowest first."""
    sources, times = read_step(hlo, log)
    rows = [(ms, k, sources[k]) for k, ms in times.items() if pattern in sources.get(k, "")]
    return sorted(rows, reverse=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="HLO LOG [HLO2 LOG2]")
    parser.add_argument("--scale", type=float, default=1.0, help="factor on the first step")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--line", help="list the kernels of the source lines containing this")
    args = parser.parse_args()
    if len(args.files) not in (2, 4):
        parser.error(f"give HLO LOG or HLO LOG HLO2 LOG2, got {len(args.files)} files")
    if args.line is not None:
        for hlo, log in zip(args.files[::2], args.files[1::2]):
            rows = kernels_of_line(hlo, log, args.line)
            print(f"{log}: {sum(r[0] for r in rows):.3f} ms in {len(rows)} kernels")
            for ms, kernel, source in rows[: args.top]:
                print(f"{ms:8.3f} ms  {kernel}  ({source})")
        return
    first = by_source(*args.files[:2])
    if len(args.files) == 2:
        for key, ms in sorted(first.items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"{ms:8.3f} ms  {key}")
        return
    second = by_source(*args.files[2:])
    print(f"sum: first x {args.scale} = {sum(first.values()) * args.scale:.2f} ms, "
          f"second = {sum(second.values()):.2f} ms")  # fmt: skip
    diff = {k: second.get(k, 0.0) - args.scale * first.get(k, 0.0) for k in {*first, *second}}
    for key in sorted(diff, key=lambda k: -abs(diff[k]))[: args.top]:
        print(f"{diff[key]:+8.3f} ms  (first {args.scale * first.get(key, 0):7.3f}, "
              f"second {second.get(key, 0):7.3f})  {key}")  # fmt: skip


if __name__ == "__main__":
    main()
