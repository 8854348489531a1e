"""Timing helpers shared by the kernel benchmarks: synchronised medians, pipelined means,
per-kernel GPU times from the JAX profiler, the collectives of a compiled program,
`name:key=value,...` tuning configurations, and the rows the benchmarks print and write."""

import bisect
import collections
import contextlib
import gc
import glob
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

import jax


def jax_callable(forward, args, dy=None):
    """A no-argument callable running jit(forward)(*args), or with `dy` forward plus its vjp of
    dy. y is returned too (unused, XLA would drop the kernel computing it: the backward does not
    need y) and dy is an argument (a closed-over constant would be folded into the program)."""
    if dy is None:
        fn = jax.jit(forward)
        return lambda: fn(*args)

    def fwd_bwd(dy, *a):
        y, vjp = jax.vjp(forward, *a)
        return y, vjp(dy)

    fn = jax.jit(fwd_bwd)
    return lambda: fn(dy, *args)


def median_ms(fn, reps, sync):
    """Median wall time of fn() in ms after two warm-up calls."""
    for _ in range(2):
        sync(fn())
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        sync(fn())
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def pipelined_ms(fn, reps, sync):
    """Mean time per call in ms of `reps` calls issued back to back, synchronised once at the
    end: the host's dispatch overlaps the device's work (what a training loop sees, and what
    CUDA-event timers like triton.testing.do_bench measure), unlike median_ms, which adds one
    dispatch-and-wait latency per call."""
    for _ in range(2):
        sync(fn())
    start = time.perf_counter()
    for _ in range(reps):
        out = fn()
    sync(out)
    return (time.perf_counter() - start) * 1e3 / reps


def trace(fn, reps):
    """The profiler's ProfileData of `reps` calls of fn() (after one untraced call)."""
    jax.block_until_ready(fn())
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        for _ in range(reps):
            out = fn()
        jax.block_until_ready(out)
        jax.profiler.stop_trace()
        (path,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
        return jax.profiler.ProfileData.from_file(path)


@contextlib.contextmanager
def full_collections():
    """Yields a list that receives the duration (s) of every full (oldest-generation) Python
    garbage collection while the block runs: after tracing a large program the heap holds about
    a million objects, and one such pass stops the host for a good part of a second."""
    pauses, began = [], []

    def record(phase, info):
        if info["generation"] != 2:
            return
        if phase == "start":
            began.append(time.perf_counter())
        elif began:
            pauses.append(time.perf_counter() - began.pop())

    gc.callbacks.append(record)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(record)


def _kernel_lines(data, plane_prefix):
    """(plane name, line) of the per-stream kernel lines (not the summaries) of the planes whose
    name starts with `plane_prefix`."""
    for plane in data.planes:
        if plane.name.startswith(plane_prefix):
            for line in plane.lines:
                if line.name.startswith("Stream"):
                    yield plane.name, line


def kernel_times_us(fn, reps=10, plane_prefix="/device:GPU"):
    """{GPU kernel name: microseconds per call of fn()} from a profiler trace of `reps` calls
    (XLA fusions by their HLO name, Pallas kernels by their kernel function's name), summed over
    the planes whose name starts with `plane_prefix` (e.g. "/device:GPU:0" for one GPU)."""
    return kernel_times_of(trace(fn, reps), reps, plane_prefix)


def kernel_times_of(data, reps, plane_prefix="/device:GPU"):
    """`kernel_times_us` of a trace of `reps` calls already taken (`trace`)."""
    totals = collections.Counter()
    for _, line in _kernel_lines(data, plane_prefix):
        for event in line.events:
            totals[event.name] += event.duration_ns / 1e3 / reps
    return dict(totals.most_common())


def _merged(intervals):
    """The union of (start, end) intervals as sorted disjoint intervals: (starts, ends)."""
    starts, ends = [], []
    for start, end in sorted(intervals):
        if ends and start <= ends[-1]:
            ends[-1] = max(ends[-1], end)
        else:
            starts.append(start)
            ends.append(end)
    return starts, ends


def _uncovered_ns(start, end, merged):
    """How much of [start, end) the sorted disjoint intervals `merged` (`_merged`) leave
    uncovered."""
    starts, ends = merged
    i = max(bisect.bisect_right(starts, start) - 1, 0)
    covered = 0
    while i < len(starts) and starts[i] < end:
        covered += max(0, min(ends[i], end) - max(starts[i], start))
        i += 1
    return end - start - covered


def timeline_us(data, reps, gaps=0):
    """Per GPU plane, per call, in microseconds: the span from its first kernel to its last, the
    time some non-NCCL kernel runs (compute), the NCCL kernels' total and the part of it no
    compute kernel overlaps (exposed: waiting for the other GPUs or moving data), the time no
    kernel runs (idle); each NCCL kernel's exposed time; the `gaps` compute kernels that run
    longest beside an NCCL kernel, and the `gaps` longest idle stretches (`_longest_gaps`, over
    all calls)."""
    planes = collections.defaultdict(lambda: ([], []))
    for plane, line in _kernel_lines(data, "/device:GPU"):
        for event in line.events:
            nccl = event.name.startswith("ncclDevKernel")
            planes[plane][nccl].append((event.start_ns, event.end_ns, event.name))
    result = {}
    for plane, (compute, nccl) in sorted(planes.items()):
        every = compute + nccl
        span = max(e for _, e, _ in every) - min(s for s, _, _ in every)
        busy = _merged([(s, e) for s, e, _ in compute])
        exposed = collections.Counter()
        for s, e, name in nccl:
            exposed[name.split("(")[0]] += _uncovered_ns(s, e, busy)
        parts = dict(
            span=span,
            compute=sum(e - s for s, e in zip(*busy)),
            nccl=sum(e - s for s, e, _ in nccl),
            nccl_exposed=sum(exposed.values()),
        )
        parts["idle"] = span - parts["compute"] - parts["nccl_exposed"]
        # Compute kernels sharing the GPU with a collective (its SMs and memory bandwidth).
        comm = _merged([(s, e) for s, e, _ in nccl])
        shared = collections.Counter()
        for s, e, name in compute:
            shared[name] += e - s - _uncovered_ns(s, e, comm)
        result[plane] = {
            "parts": {k: v / 1e3 / reps for k, v in parts.items()},
            "exposed": {k: v / 1e3 / reps for k, v in exposed.most_common()},
            "beside_nccl": {k: v / 1e3 / reps for k, v in shared.most_common(gaps) if v},
            "gaps": _longest_gaps(every, gaps),
        }
    return result


def layer_timeline_us(data, anchor: str, layers: int, layer: int):
    """One decode step's kernels around one layer, from a trace of a decode loop (`trace`): the
    kernels whose name starts with `anchor` run once a layer and step and mark where each layer
    starts. Of the middle step: its span, the time some kernel runs (busy) and the kernels' sum
    (above busy: kernels ran at once), in us; and of its layer `layer`, each kernel as (start
    from the layer's anchor, duration, stream, name), the anchor's first. ValueError when fewer
    than two steps of anchors are traced."""
    events = sorted(
        (e.start_ns, e.end_ns, line.name, e.name)
        for _, line in _kernel_lines(data, "/device:GPU")
        for e in line.events
    )
    starts = [s for s, _, _, name in events if name.startswith(anchor)]
    steps = len(starts) // layers
    if steps < 2:
        raise ValueError(f"{len(starts)} kernels named {anchor}*: not two steps of {layers} layers")
    first = (steps // 2) * layers
    begin, end = starts[first], starts[first + layers]
    step = [(s, e) for s, e, _, _ in events if begin <= s < end]
    busy = sum(e - s for s, e in zip(*_merged(step)))
    layer_begin, layer_end = starts[first + layer], starts[first + layer + 1]
    kernels = [
        ((s - layer_begin) / 1e3, (e - s) / 1e3, stream, name)
        for s, e, stream, name in events
        if layer_begin <= s < layer_end
    ]
    return {
        "step_us": (end - begin) / 1e3,
        "busy_us": busy / 1e3,
        "kernel_sum_us": sum(e - s for s, e in step) / 1e3,
        "layer_us": (layer_end - layer_begin) / 1e3,
        "layer_kernels": kernels,
    }


def print_layer_timeline(data, anchor: str, layers: int, label: str) -> None:
    """Prints `layer_timeline_us` of the middle layer: the step's sums, then a line a kernel."""
    timeline = layer_timeline_us(data, anchor, layers, layers // 2)
    kernels = timeline.pop("layer_kernels")
    sums = ", ".join(f"{k} {v:.1f}" for k, v in timeline.items())
    print(f"{label}, layer {layers // 2}: {sums}")
    for start, length, stream, kernel in kernels:
        print(f"  {start:7.2f} +{length:6.2f}  {stream[-12:]:>12}  {kernel[:70]}", flush=True)


def print_step_profile(name: str, one_step, top: int, reps: int = 3) -> None:
    """Profiles `reps` calls of one_step() (a train step) and prints each GPU's timeline (compute,
    NCCL, exposed NCCL, idle; the longest idle gaps), then the `top` costliest kernels of the
    GPU that computes longest: the one the others wait for (theirs share the GPU with NCCL
    kernels waiting for it)."""
    data = trace(one_step, reps=reps)
    timelines = timeline_us(data, reps=reps, gaps=8)
    for plane, timeline in timelines.items():
        listed = ", ".join(f"{k} {v / 1e3:.2f}" for k, v in timeline["parts"].items())
        where = plane.removeprefix("/device:")
        print(f"timeline of {name} on {where}, ms a step: {listed}")
        for kernel, us in timeline["exposed"].items():
            print(f"  {us / 1e3:8.3f} ms exposed  {kernel}")
        for kernel, us in timeline["beside_nccl"].items():
            print(f"  {us / 1e3:8.3f} ms beside NCCL  {kernel[:80]}")
        for us, before, after in timeline["gaps"]:
            print(f"  {us / 1e3:8.3f} ms idle  after {before}  before {after}")
    if timelines:
        busiest = max(timelines, key=lambda p: timelines[p]["parts"]["compute"])
        times = kernel_times_of(data, reps=reps, plane_prefix=busiest)
        where = busiest.removeprefix("/device:")
        print(f"{where} kernels of {name}: {sum(times.values()) / 1e3:.2f} ms per step")
        for kernel, us in list(times.items())[:top]:
            print(f"  {us / 1e3:8.3f} ms  {kernel[:100]}")


def _longest_gaps(events, count):
    """The `count` longest stretches with no kernel running, in microseconds, each with the
    kernels that end before and start after it: [(us, before, after)]."""
    ordered = sorted(events)
    found, reach, last = [], None, None
    for start, end, name in ordered:
        if reach is not None and start > reach:
            found.append(((start - reach) / 1e3, last[:60], name[:60]))
        if reach is None or end > reach:
            reach, last = end, name
    return sorted(found, reverse=True)[:count]


# A collective's result in optimized HLO: plain (synchronous, or inside an async computation) or
# the `-done` of an async pair (whose result is the output alone; `-start` also holds the input).
_COLLECTIVE = re.compile(
    r"= (\S+|\(.*?\)) (all-gather|all-reduce|collective-permute|reduce-scatter|all-to-all)"
    r"(-done)?\("
)
_ARRAY = re.compile(r"(pred|[a-z]+\d+)\[([\d,]*)\]")
_BITS = re.compile(r"\d+$")


def kernel_summary_us(fn):
    """`kernel_times_us(fn)` of the kernels that take at least 1 us, rounded to 0.1 us."""
    return {k: round(v, 1) for k, v in kernel_times_us(fn).items() if v >= 1.0}


def compare_to_peer(row: dict, peer_ms: str) -> None:
    """Adds to `row` pallas_best_ms (its fastest pallas_* time) and, when it holds the peer's
    time `peer_ms` (and "pipelined_" + peer_ms), the ratios to it, synchronised and pipelined."""
    row["pallas_best_ms"] = min(v for k, v in row.items() if k.startswith("pallas_"))
    if peer_ms in row:
        row["ratio_vs_mamba_ssm"] = row["pallas_best_ms"] / row[peer_ms]
        best_pipelined = min(
            v for k, v in row.items() if k.startswith("pipelined_") and "mamba" not in k
        )
        row["pipelined_ratio_vs_mamba_ssm"] = best_pipelined / row[f"pipelined_{peer_ms}"]


def emit(rows: list, row: dict) -> None:
    """Keeps `row` and prints it as one JSON line."""
    rows.append(row)
    print(json.dumps(row), flush=True)


def write_rows(path: str | None, rows: list) -> None:
    """The rows and the device kind as JSON at `path` (a benchmark's --json), if given."""
    if path:
        with open(path, "w") as f:
            json.dump(dict(device=str(jax.devices()[0].device_kind), rows=rows), f, indent=1)


def array_bytes(type_text: str) -> list[int]:
    """Bytes of each array in an HLO result type, e.g. "(f32[2,3]{1,0}, bf16[4]{0})", in order."""
    return [size for _, size in typed_array_bytes(type_text)]


def result_bytes(type_text: str, op: str) -> list[int]:
    """Bytes of each array an HLO instruction `op` makes, from its result type: an async start's
    ((operands), result) holds its operands too, which are not its to make."""
    sizes = array_bytes(type_text)
    if op.endswith("-start") and type_text.startswith("(("):
        return sizes[len(sizes) // 2 :]
    return sizes


def typed_array_bytes(type_text: str) -> list[tuple[str, int]]:
    """(dtype, bytes) of each array in an HLO result type, in order."""
    sizes = []
    for dtype, dims in _ARRAY.findall(re.sub(r"\{.*?\}", "", type_text)):
        size = 1
        for d in filter(None, dims.split(",")):
            size *= int(d)
        bits = 8 if dtype == "pred" else int(_BITS.search(dtype).group())
        sizes.append((dtype, size * bits // 8))
    return sizes


def collectives_by_kind(hlo: str) -> dict[str, tuple[int, int, dict[str, int]]]:
    """{kind: (count, bytes of their results, {dtype: bytes})} of the collectives in optimized
    HLO text."""
    totals = collections.defaultdict(lambda: [0, 0, collections.Counter()])
    for match in _COLLECTIVE.finditer(hlo):
        kind = match.group(2)
        totals[kind][0] += 1
        for dtype, size in typed_array_bytes(match.group(1)):
            totals[kind][1] += size
            totals[kind][2][dtype] += size
    return {
        kind: (n, size, dict(sorted(by.items()))) for kind, (n, size, by) in sorted(totals.items())
    }


def ascending_ints(text: str, flag: str) -> list[int]:
    """A command line's "8,16,32" -> [8, 16, 32]; SystemExit with one error line naming `flag`
    and the value unless they are positive integers in ascending order."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise SystemExit(f"error: {flag} must be comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values) or values != sorted(set(values)):
        raise SystemExit(f"error: {flag} must be positive and ascending, got {text!r}")
    return values


def check_sizes(parser, args, *, zero_ok=()) -> None:
    """parser.error naming the first integer argument (or element of a list of them) below 1 (below
    0 for the names in zero_ok): the benches' sizes, lengths and repeats."""
    for name, value in vars(args).items():
        least = 0 if name in zero_ok else 1
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) and not isinstance(v, bool) and v < least:
                parser.error(f"--{name.replace('_', '-')} must be at least {least}, got {v}")


def known_names(parser, flag: str, names: list[str], known) -> list[str]:
    """`names`, given by `flag`; parser.error naming those not in `known` (and listing it)."""
    unknown = sorted(set(names) - set(known))
    if unknown:
        parser.error(f"unknown {flag} {','.join(unknown)}; known: {','.join(known)}")
    return names


def make_dir(parser, flag: str, path) -> None:
    """Creates the directory a flag names before compiling; parser.error naming it if it cannot."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        parser.error(f"{flag} {path}: {err.strerror}")


def parse_config(text):
    """'name:key=value,key=value' -> (name, {key: value}), values ints or true / false."""
    name, _, rest = text.partition(":")
    kw = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        bools = {"true": True, "false": False}
        kw[key] = bools[value.lower()] if value.lower() in bools else int(value)
    return name, kw


def print_compiled_account(name: str, extra, compiled, hlo: str) -> None:
    """Prints a compiled train step's collectives by kind (count, MiB a step, MiB by dtype) and
    XLA's own account of one device's buffers (the allocator's peak also holds what compiling and
    autotuning took)."""
    print(f"collectives of one {name} step ({' '.join(extra)}):")
    for kind, (count, size, by_dtype) in collectives_by_kind(hlo).items():
        dtypes = ", ".join(f"{dtype} {n / 2**20:.2f}" for dtype, n in by_dtype.items())
        print(f"  {kind:20s} {count:5d}  {size / 2**20:10.2f} MiB  ({dtypes})")
    memory = compiled.memory_analysis()
    if memory is not None:
        sizes = {
            "arguments": memory.argument_size_in_bytes,
            "outputs": memory.output_size_in_bytes,
            "aliased": memory.alias_size_in_bytes,
            "temporaries": memory.temp_size_in_bytes,
        }
        listed = ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in sizes.items())
        print(f"memory of one {name} step per device: {listed}")
