"""Run-time reporting for train.py: metrics.jsonl + TensorBoard events, and the progress bar."""

import json
import sys
import time
from pathlib import Path

import jax


def _summary_writer(logdir: Path, purge_step: int | None):
    """tensorboardX's SummaryWriter (the `tensorboard` extra), or None with a note on stderr."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        print(
            "note: no TensorBoard events (pip install 'hax-jax[tensorboard]'); "
            "metrics.jsonl holds every value",
            file=sys.stderr,
        )
        return None
    # purge_step: TensorBoard hides the events a killed run logged past its last checkpoint. The
    # suffix keeps a resume within the same second from reusing (and truncating) the first file.
    return SummaryWriter(
        str(logdir), purge_step=purge_step, flush_secs=30, filename_suffix=f".{time.time_ns()}"
    )


def device_memory() -> dict:
    """{"peak_gib": the most memory any of this process's devices has held so far}, where the
    backend counts it (GPU, TPU); {} where it does not (CPU)."""
    peaks = [
        stats["peak_bytes_in_use"]
        for stats in (device.memory_stats() for device in jax.local_devices())
        if stats and "peak_bytes_in_use" in stats
    ]
    return {"peak_gib": max(peaks) / 2**30} if peaks else {}


class Metrics:
    """metrics.jsonl and TensorBoard events, written by process 0 only."""

    def __init__(self, workdir: Path, resumed_at: int | None = None):
        self.active = jax.process_index() == 0
        if self.active:
            path = workdir / "metrics.jsonl"
            if resumed_at is not None and path.exists():  # drop what the resumed steps will redo
                lines = path.read_text().splitlines(keepends=True)
                path.write_text("".join(x for x in lines if json.loads(x)["step"] <= resumed_at))
            self.jsonl = open(path, "a")
            purge = None if resumed_at is None else resumed_at + 1
            self.tensorboard = _summary_writer(workdir / "tensorboard", purge)

    def write(self, step: int, values: dict) -> None:
        """One JSON line and one scalar per value."""
        if not self.active:
            return
        self.jsonl.write(json.dumps({"step": step, **values}) + "\n")
        self.jsonl.flush()
        if self.tensorboard is not None:  # written by tensorboardX's thread; all by close()
            for name, value in values.items():
                self.tensorboard.add_scalar(name, value, step)

    def close(self) -> None:
        """Writes out everything (tensorboardX's flush does not wait for its queue)."""
        if self.active:
            self.jsonl.close()
            if self.tensorboard is not None:
                self.tensorboard.close()


class ProgressBar:
    """A rich progress bar with loss, accuracy, lr and tokens/s (on stderr; off when disabled)."""

    def __init__(self, enabled: bool, start: int, total: int):
        self.enabled = enabled and jax.process_index() == 0
        self.start, self.total = start, total

    def __enter__(self):
        if self.enabled:
            from rich.console import Console  # rich comes with flax
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )

            self.progress = Progress(
                TextColumn("train"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"),
                console=Console(stderr=True),
            )
            self.progress.__enter__()
            self.task = self.progress.add_task(
                "train", total=self.total, completed=self.start, info=""
            )
        return self

    def __call__(self, step: int, values: dict) -> None:
        """Moves the bar to `step` and shows the latest values."""
        if self.enabled:
            info = (
                f"loss {values['loss']:.4f} acc {values['accuracy']:.3f} lr {values['lr']:.2e} "
                f"{values['tokens_per_s']:,.0f} tok/s"
            )
            self.progress.update(self.task, completed=step, info=info)

    def __exit__(self, *exc):
        if self.enabled:
            self.progress.__exit__(*exc)
