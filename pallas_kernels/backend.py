"""Which Pallas variant runs where, and how kernels are cross-lowered for checking.

Every kernel comes in two variants that share their math: "gpu" (Pallas Triton: power-of-two
blocks, grids of independent programs) and "tpu" (Mosaic TPU: blocks whose last two dims are
(8, 128)-tiled or whole, sequential grid axes marked "arbitrary"). On a CPU there is no
compiler for either, so the kernels run in Pallas interpret mode: plain `interpret=True` for
the gpu variant (fast enough for CI shapes) and `pltpu.InterpretParams()` for the tpu variant
(TPU semantics, ~4000x slower: tiny shapes only).
"""

import os

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

VARIANTS = ("gpu", "tpu")


def default_variant():
    """The variant for the default backend: "tpu" on TPU, else "gpu" (interpreted on CPU)."""
    return "tpu" if jax.default_backend() == "tpu" else "gpu"


def kernels_by_default():
    """Whether impl="auto" prefers the Pallas kernels on this backend: on a GPU (where they were
    measured faster than the pure-JAX paths, BENCHMARKS.md). TPU keeps the pure-JAX paths until
    the Mosaic variants are measured on a TPU."""
    return jax.default_backend() == "gpu"


def auto_picks_pallas():
    """Whether impl="auto" takes the Pallas kernels here: `kernels_by_default()`, and not under
    a multi-device mesh with automatically partitioned axes (XLA cannot split a kernel's custom
    call; GSPMD partitions the pure-JAX path instead). Inside shard_map (manual axes) each
    device runs its kernel: hax_jax's layers call the ops that way under a mesh whose "seq"
    axis is 1 (hax_jax/parallel.py)."""
    if not kernels_by_default():
        return False
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return True
    return all(kind == jax.sharding.AxisType.Manual for kind in mesh.axis_types)


COMMAND_BUFFER_FLAG = "xla_gpu_enable_command_buffer"


def _command_buffer_tokens(flags):
    """The --xla_gpu_enable_command_buffer tokens of an XLA_FLAGS string, in order."""
    return [t for t in flags.split() if t.partition("=")[0].lstrip("-") == COMMAND_BUFFER_FLAG]


def custom_calls_in_cuda_graphs(xla_flags=None):
    """Whether XLA:GPU records custom calls (a Mosaic GPU kernel is one) into its command buffers
    (CUDA graphs), as the last --xla_gpu_enable_command_buffer of `xla_flags` (default: the
    XLA_FLAGS variable) says: absent, XLA's default set, which has CUSTOM_CALL; empty, no
    command buffers; TYPE,TYPE the set; +TYPE / -TYPE edits of the default set."""
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    values = [t.partition("=")[2] for t in _command_buffer_tokens(flags) if "=" in t]
    if not values:
        return True
    types = [t.strip() for t in values[-1].split(",") if t.strip()]
    if not types:
        return False
    if not all(t[0] in "+-" for t in types):
        return "CUSTOM_CALL" in types
    recorded = True
    for edit in types:
        if edit[1:] == "CUSTOM_CALL":
            recorded = edit[0] == "+"
    return recorded


def keep_custom_calls_out_of_cuda_graphs():
    """Adds --xla_gpu_enable_command_buffer=-CUSTOM_CALL to XLA_FLAGS unless the flag is set
    there already. For command lines, before JAX starts its GPU backend (later it has no
    effect). Why: recorded into CUDA graphs, Mosaic GPU kernels cost host time, so the SSD takes
    them only with custom calls kept out (`kernel_mgpu.use_mosaic_gpu`). The whole 130M step on
    an H100 measured no difference beyond the run-to-run spread among Mosaic GPU out of the
    graphs, Triton out of them and Triton in them (BENCHMARKS.md, 2026-11-25)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if _command_buffer_tokens(flags):
        return
    os.environ["XLA_FLAGS"] = f"{flags} --{COMMAND_BUFFER_FLAG}=-CUSTOM_CALL".strip()


def check_variant(variant):
    """ValueError naming `variant` unless it is one of VARIANTS."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")


def interpret_for(variant, interpret=None):
    """The `interpret=` argument of pallas_call: None decides from the backend (compiled on the
    variant's own hardware, interpreted anywhere else); True forces interpretation."""
    native = {"gpu": ("gpu", "cuda", "rocm"), "tpu": ("tpu",)}[variant]
    if interpret is None:
        interpret = jax.default_backend() not in native
    if not interpret:
        return False
    return pltpu.InterpretParams() if variant == "tpu" else True


def mosaic_gpu_interpret_params(interpret, num_threads):
    """The `interpret=` argument of plgpu.kernel (the SSD's kernel_mgpu.py): Mosaic GPU's
    interpreter on a CPU (or when forced with True), else compiled. RuntimeError if the interpreter
    would deadlock."""
    if interpret is None:
        interpret = jax.default_backend() not in ("gpu", "cuda")
    if not interpret:
        return None
    # One thread per warpgroup, plus the one running the computation that called the kernel.
    needed, cpu_threads = num_threads + 1, _xla_cpu_threads()
    if cpu_threads < needed:
        raise RuntimeError(
            f"Mosaic GPU's interpreter runs this kernel's {num_threads} warpgroups on the XLA CPU "
            f"client's {cpu_threads} threads and would wait forever on its barriers; start the "
            f"process with NPROC={needed} (or more) in the environment"
        )
    params = getattr(plgpu, "InterpretGPUParams", None)  # public from jax 0.11
    if params is None:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as params
    return params()


def _xla_cpu_threads():
    """Threads of XLA's CPU client pool, which runs the interpreter's callbacks: NPROC if set
    (read when jax starts its CPU backend), else the CPUs this process may use."""
    nproc = os.environ.get("NPROC", "")
    if nproc.isdigit():
        return int(nproc)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def compiler_params(variant, *, num_warps=4, num_stages=2, dimension_semantics=None):
    """Compiler parameters of a pallas_call: Triton's for gpu, Mosaic's for tpu."""
    if variant == "gpu":
        return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    return pltpu.CompilerParams(dimension_semantics=dimension_semantics)


def lower_for(platform, fn, *args, **kwargs):
    """Lower jit(fn)(*args, **kwargs) for "cuda" or "tpu" on any host: catches unsupported
    primitives and bad block shapes of the compiled (not interpreted) kernel without the
    hardware. Returns the lowered module's text."""
    lowered = jax.jit(fn).trace(*args, **kwargs).lower(lowering_platforms=(platform,))
    return lowered.as_text()


__all__ = [
    "VARIANTS",
    "auto_picks_pallas",
    "check_variant",
    "compiler_params",
    "custom_calls_in_cuda_graphs",
    "default_variant",
    "interpret_for",
    "keep_custom_calls_out_of_cuda_graphs",
    "kernels_by_default",
    "lower_for",
    "mosaic_gpu_interpret_params",
]
