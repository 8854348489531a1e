"""Test-wide settings: 8 simulated CPU devices, fast CPU compiles, a shared compilation cache,
enough XLA CPU threads for Mosaic GPU's interpreter, offline HF, full-precision matmuls, the gpu
marker."""

import os
import tempfile

# Before jax is imported anywhere: sharding tests need several (simulated) devices.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
# Without a GPU the suite's tiny programs spend most of their time in LLVM's optimisation passes
# (they change speed, not XLA's float semantics): skipping them cut test_train.py's slowest tests
# from 142 s to ~100 s on a 2-core machine. With a GPU the compiled tests keep the default pipeline.
if not os.path.exists("/dev/nvidiactl") and "xla_backend_optimization_level" not in os.environ.get(
    "XLA_FLAGS", ""
):
    os.environ["XLA_FLAGS"] += (
        " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    )
# XLA's CPU client runs Mosaic GPU's interpreter callbacks on a pool sized by the CPUs (or
# NPROC): a 2-core machine deadlocks a 3-warpgroup kernel (pallas_kernels/ssd/kernel_mgpu.py).
os.environ.setdefault("NPROC", str(max(os.cpu_count() or 1, 4)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("USE_HUB_KERNELS", "0")  # transformers must not fetch kernels from the hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One compilation cache for the suite's processes (both xdist workers and the train.py processes
# the tests launch, which inherit it): resumed runs, second processes and tests sharing a model
# compile the same programs again (test_train.py + test_multiprocess.py: 208 s -> 159 s on a
# 2-core machine). Keyed by program, flags and jax version; capped, least recently used dropped.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(tempfile.gettempdir(), f"hax_jax_test_compile_cache_{os.getuid()}"),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
# Generated evaluation splits (hax_jax.data.split_cache) of the suite's runs, not the user's cache.
os.environ.setdefault(
    "HAX_JAX_CACHE",
    os.path.join(tempfile.gettempdir(), f"hax_jax_test_data_cache_{os.getuid()}"),
)
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(2 * 2**30))

import gc

import jax
import pytest

# Parity tests compare fp32 numbers with PyTorch; TF32 matmuls (the GPU default) would blur them.
jax.config.update("jax_default_matmul_precision", "highest")


def _has_gpu() -> bool:
    """Whether jax sees a GPU."""
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    """Skips `gpu`-marked tests, visibly, when there is no GPU."""
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a GPU")
    for item in items:
        if item.get_closest_marker("gpu"):  # not `"gpu" in keywords`: a parameter id "gpu" is one
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drops jax's compiled programs after each test module. XLA's CPU JIT maps memory for every
    executable it keeps, and the whole suite's would pass Linux's vm.max_map_count (65,530): the
    next compile then crashes (a segfault in test_ssd.py after ~650 tests). One module's programs
    map ~25,000 regions at most (test_sequence_parallel_sparse.py)."""
    yield
    jax.clear_caches()
    gc.collect()  # the executables go with their last references
