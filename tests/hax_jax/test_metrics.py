"""train.py's metrics: metrics.jsonl and TensorBoard events (tensorboardX), process 0 only."""

import json
import struct

import pytest

from hax_jax.metrics import Metrics

event_pb2 = pytest.importorskip("tensorboardX.proto.event_pb2")


def _events(logdir):
    """Every Event of every events file in `logdir`, in file and record order. TFRecord framing:
    uint64 length, uint32 crc of it, the record, uint32 crc of the record (crcs not checked)."""
    out = []
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            out.append(event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length]))
            pos += 12 + length + 4
    return out


def _scalars(events):
    return [(e.step, v.tag, v.simple_value) for e in events for v in e.summary.value]


def test_values_reach_jsonl_and_tensorboard(tmp_path):
    metrics = Metrics(tmp_path)
    metrics.write(1, {"loss": 2.5, "lr": 1e-3})
    metrics.write(2, {"loss": 2.25})
    metrics.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": 1, "loss": 2.5, "lr": 1e-3}, {"step": 2, "loss": 2.25}]
    scalars = _scalars(_events(tmp_path / "tensorboard"))
    assert scalars == [(1, "loss", 2.5), (1, "lr", pytest.approx(1e-3)), (2, "loss", 2.25)]


def test_a_resumed_run_drops_and_purges_the_steps_it_redoes(tmp_path):
    """A run killed at step 3 with its checkpoint at 2: the resume drops steps > 2 from
    metrics.jsonl and starts its events with a purge at step 3 (TensorBoard hides the old)."""
    first = Metrics(tmp_path)
    for step in (1, 2, 3):
        first.write(step, {"loss": float(step)})
    first.close()
    resumed = Metrics(tmp_path, resumed_at=2)
    resumed.write(3, {"loss": 30.0})
    resumed.close()
    steps = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m["loss"]) for m in steps] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    events = _events(tmp_path / "tensorboard")
    purges = [e.step for e in events if e.session_log.status == event_pb2.SessionLog.START]
    assert purges == [3]
    assert _scalars(events)[-1] == (3, "loss", 30.0)


class _Device:
    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_device_memory_reports_the_largest_peak_or_nothing(monkeypatch):
    from hax_jax import metrics

    gib = 2**30
    devices = [_Device({"peak_bytes_in_use": 3 * gib}), _Device({"peak_bytes_in_use": 5 * gib})]
    monkeypatch.setattr(metrics.jax, "local_devices", lambda: devices)
    assert metrics.device_memory() == {"peak_gib": 5.0}
    monkeypatch.setattr(metrics.jax, "local_devices", lambda: [_Device(None), _Device({})])
    assert metrics.device_memory() == {}  # CPU: memory_stats() is None
