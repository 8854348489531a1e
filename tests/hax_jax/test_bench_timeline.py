"""bench/timing.timeline_us, the source of BENCHMARKS.md's per-GPU compute / exposed NCCL / idle
columns: checked on a hand-made trace whose answer is counted by hand; and full_collections, the
garbage-collection count train_throughput.py prints."""

from types import SimpleNamespace

import pytest
from scripts import load_script

timing = load_script("bench/timing.py", "bench_timing")


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


def test_layer_timeline_on_a_hand_made_trace():
    """Two layers a step, three steps traced; anchor "sel" starts each layer (at 0, 10, ..., 50
    us). The middle step is [20, 40) us, where "x" and "y" overlap; its layer 1, [30, 40) us,
    holds sel and "z" (another stream)."""
    sel = [_event(t * 1000, t * 1000 + 2000, "sel_kernel") for t in (0, 10, 20, 30, 40, 50)]
    other = [_event(21_000, 26_000, "x"), _event(33_000, 36_000, "z")]
    data = _trace(sel, other + [_event(24_000, 28_000, "y")])
    got = timing.layer_timeline_us(data, "sel", layers=2, layer=1)
    # step [20, 40): sel [20, 22) and [30, 32), x [21, 26), y [24, 28), z [33, 36)
    assert got["step_us"] == 20.0 and got["layer_us"] == 10.0
    assert got["busy_us"] == 8.0 + 2.0 + 3.0  # [20, 28) + [30, 32) + [33, 36)
    assert got["kernel_sum_us"] == 2 + 2 + 5 + 4 + 3
    assert got["layer_kernels"] == [
        (0.0, 2.0, "Stream #0", "sel_kernel"),
        (3.0, 3.0, "Stream #1", "z"),
    ]
    with pytest.raises(ValueError, match="3 kernels named nope"):
        timing.layer_timeline_us(_trace([_event(0, 1, "nope")] * 3), "nope", layers=2, layer=0)


def test_collectives_by_kind_counts_bytes_by_dtype():
    """`--collectives`' account on hand-made optimized HLO: an async collective counted once, at its
    done, a joined one by each of its arrays, bytes split by dtype."""
    hlo = """
  %ars = (bf16[8,4]{1,0}, f32[4]{0}) all-reduce-start(bf16[8,4]{1,0} %a, f32[4]{0} %b)
  %ard = (bf16[8,4]{1,0}, f32[4]{0}) all-reduce-done((bf16[8,4]{1,0}, f32[4]{0}) %ars)
  %ags = (bf16[2,4]{1,0}, bf16[4,4]{1,0}) all-gather-start(bf16[2,4]{1,0} %c), dimensions={0}
  %agd = bf16[4,4]{1,0} all-gather-done((bf16[2,4]{1,0}, bf16[4,4]{1,0}) %ags)
  %ag = f32[6]{0} all-gather(f32[3]{0} %d), dimensions={0}
"""
    assert timing.collectives_by_kind(hlo) == {
        "all-gather": (2, 32 + 24, {"bf16": 32, "f32": 24}),
        "all-reduce": (1, 64 + 16, {"bf16": 64, "f32": 16}),
    }
