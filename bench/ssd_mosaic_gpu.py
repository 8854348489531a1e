"""SSD forward kernels on Hopper: Pallas-Triton (kernel.py) vs Mosaic GPU (kernel_mgpu.py).

    python bench/ssd_mosaic_gpu.py [--reps 20] [--profile] [--json out.json]

Issue #6 asks for whichever GPU backend measures faster. Times chunk_state and chunk_out, the
forward's two matmul kernels, at the issue's shapes (b8, l2048, h24, p64, n128) and
(b2, l8192, h80, p64, n128), chunk 256, bf16, one group: each a jitted call that prepares the
inputs (pallas.Prepared) and runs one kernel on the same values; chunk_out is given the same
incoming states. Prints sync / pipelined ms (bench/timing.py), the largest difference between
the two kernels' outputs, and with --profile the kernels' own GPU times.
"""

import argparse

import jax
import jax.numpy as jnp
import ml_dtypes

from bench.ssd_kernel import CHUNK, FWD_BWD, make_inputs
from bench.timing import emit, kernel_summary_us, median_ms, pipelined_ms, write_rows
from pallas_kernels.ssd import kernel as triton
from pallas_kernels.ssd import kernel_mgpu as mgpu
from pallas_kernels.ssd import pallas, state_passing
from pallas_kernels.ssd.tiling import resolve_block_sizes

KERNELS = {
    "chunk_state": (triton.chunk_states, mgpu.chunk_states_mgpu),
    "chunk_out": (triton.chunk_outputs, mgpu.chunk_outputs_mgpu),
}


def case(name, impl, sizes, h_in):
    """A jitted function of the raw inputs running one kernel (h_in: chunk_out's states)."""

    def run(x, dt, A, B, C, D):
        prep = pallas.Prepared(x, dt, A, B, C, D, None, CHUNK, "gpu", sizes)
        if name == "chunk_state":
            return impl(prep, prep.x, prep.w_state * prep.dt, prep.B)
        return impl(prep, h_in)

    return jax.jit(run)


def incoming_states(args, sizes):
    """The states entering each chunk (Triton path), chunk_out's input."""

    def run(x, dt, A, B, C, D):
        prep = pallas.Prepared(x, dt, A, B, C, D, None, CHUNK, "gpu", sizes)
        S = triton.chunk_states(prep, prep.x, prep.w_state * prep.dt, prep.B)
        return state_passing.pass_states(prep, S, pallas.pad_state(prep, None))[0]

    return jax.jit(run)(*args)


def main():
    """One JSON line per (shape, kernel)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    sync = jax.block_until_ready
    rows = []
    for shape in FWD_BWD:
        inp = make_inputs(*shape, ml_dtypes.bfloat16)
        arrays = [jnp.asarray(inp[k]) for k in ("x", "dt", "A", "B", "C", "D")]
        sizes = resolve_block_sizes("gpu", CHUNK, shape[2])
        h_in = incoming_states(arrays, sizes)
        for name, impls in KERNELS.items():
            row, outs = dict(shape=shape, kernel=name), []
            for backend, impl in zip(("triton", "mosaic_gpu"), impls, strict=True):
                fn = case(name, impl, sizes, h_in)
                call = lambda fn=fn, arrays=arrays: fn(*arrays)  # noqa: E731
                outs.append(sync(call()).astype(jnp.float32))
                row[f"{backend}_ms"] = median_ms(call, args.reps, sync)
                row[f"{backend}_pipelined_ms"] = pipelined_ms(call, args.reps, sync)
                if args.profile:
                    row[f"{backend}_kernels_us"] = kernel_summary_us(call)
            row["max_abs_diff"] = float(jnp.max(jnp.abs(outs[0] - outs[1])))
            row["max_abs_triton"] = float(jnp.max(jnp.abs(outs[0])))
            row["ratio_mosaic_gpu_vs_triton"] = row["mosaic_gpu_ms"] / row["triton_ms"]
            row["pipelined_ratio_mosaic_gpu_vs_triton"] = (
                row["mosaic_gpu_pipelined_ms"] / row["triton_pipelined_ms"]
            )
            emit(rows, row)
    write_rows(args.json, rows)


if __name__ == "__main__":
    main()
