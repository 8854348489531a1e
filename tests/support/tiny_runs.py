"""Command-line overrides and subprocess settings shared by the tests that really train."""

import os

# Seconds-long joint recall: tables of up to 2 x 2 (37 positions), 16 validation examples.
TINY_JOINT_RECALL = [
    "data.batch_size=8",
    "data.joint_recall.max_n_context=2",
    "data.joint_recall.max_n_key=2",
    "data.joint_recall.n_context=(1,2)",
    "data.joint_recall.n_key=(1,2)",
    "data.joint_recall.valid_size=16",
    "model.sparse.max_len=38",
]


def subprocess_xla_flags(devices: int = 1) -> str:
    """XLA_FLAGS for a train.py subprocess: `devices` simulated CPU devices and the suite's other
    flags (conftest.py's fast CPU compiles: a launch with a device count alone compiled at full
    LLVM optimisation, 25 s instead of 14 s for test_multiprocess.py's TINY run)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    if devices > 1:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    return " ".join(flags)
