"""bench/timing.timeline_us, the source of BENCHMARKS.md's per-GPU compute / exposed NCCL / idle
columns: checked on a hand-made trace whose answer is counted by hand; and full_collections, the
garbage-collection count train_throughput.py prints."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

# bench/ is scripts, not an installed package: loaded from its file, as the tests load train.py.
_spec = importlib.util.spec_from_file_location(
    "bench_timing", Path(__file__).resolve().parents[2] / "bench" / "timing.py"
)
timing = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(timing)


def _event(start, end, name):
    return SimpleNamespace(start_ns=start, end_ns=end, duration_ns=end - start, name=name)


def _trace(*streams):
    lines = [SimpleNamespace(name=f"Stream #{i}", events=ev) for i, ev in enumerate(streams)]
    lines.append(SimpleNamespace(name="XLA Ops", events=[_event(0, 999, "summary, not a kernel")]))
    plane = SimpleNamespace(name="/device:GPU:0", lines=lines)
    return SimpleNamespace(planes=[plane, SimpleNamespace(name="/host:CPU", lines=lines)])


def test_timeline_parts_on_a_hand_made_trace():
    """Compute [0, 10) + [12, 30) + [20, 25) us on two streams; NCCL [5, 15) (exposed [10, 12))
    and [40, 50) (all exposed); idle [30, 40). Two calls traced: each total is halved (the gaps
    are listed whole)."""
    data = _trace(
        [_event(0, 10_000, "a"), _event(12_000, 30_000, "b")],
        [_event(20_000, 25_000, "c"), _event(5_000, 15_000, "ncclDevKernel_AllGather(x)")],
        [_event(40_000, 50_000, "ncclDevKernel_SendRecv(y)")],
    )
    (timeline,) = timing.timeline_us(data, reps=2, gaps=4).values()
    assert timeline["parts"] == pytest.approx(
        dict(span=25.0, compute=14.0, nccl=10.0, nccl_exposed=6.0, idle=5.0)
    )
    assert timeline["exposed"] == pytest.approx(
        {"ncclDevKernel_SendRecv": 5.0, "ncclDevKernel_AllGather": 1.0}
    )
    assert timeline["beside_nccl"] == pytest.approx({"a": 2.5, "b": 1.5})
    assert timeline["gaps"] == [(10.0, "b", "ncclDevKernel_SendRecv(y)")]


def test_full_collections_records_only_full_passes_inside_the_block():
    """train_throughput.py's count of full garbage collections: a full pass inside the block is
    recorded with its duration, a younger generation's is not, and nothing after the block."""
    import gc

    with timing.full_collections() as pauses:
        gc.collect(1)
        assert pauses == []
        gc.collect()
    gc.collect()
    assert len(pauses) == 1 and pauses[0] > 0
