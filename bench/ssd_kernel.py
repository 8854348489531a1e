"""SSD forward+backward: our Pallas kernels vs the pure-JAX chunked path vs mamba_ssm's Triton.

    python bench/ssd_kernel.py [--peer .peer] [--json out.json] [--profile]
        [--config name:key=value,key=value ...] [--cases fwd_bwd fwd fwd_fp32]
        [--shapes b,l,h,p,n ...]

Cases (issue #6): forward+backward (grads of x, dt, A, B, C, D for a random cotangent) at
(b8, l2048, h24, p64, n128) and (b2, l8192, h80, p64, n128), chunk 256, bf16 x/B/C, fp32 dt/A/D,
one group; forward alone at the same shapes and at (b1, l2048, h24, p64, n128) fp32 (--shapes
replaces the bf16 cases' shapes, e.g. 1,16384,24,64,128: a 32K row's shard on seq=2). The peer is
`mamba_chunk_scan_combined` on the same values (torch tensors); times are medians of --reps
runs after warm-up, each synchronised (block_until_ready / torch.cuda.synchronize). --config
names `BlockSizes` fields (e.g. `w8:num_warps_bwd=8,heads_per_block=4`); --profile adds each
config's per-kernel GPU times (profiler trace) to its row. `pipelined_*` times are means over
back-to-back calls synchronised once (bench/timing.py): dispatch overlaps the GPU's work.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from bench.timing import (
    compare_to_peer,
    emit,
    jax_callable,
    kernel_summary_us,
    median_ms,
    parse_config,
    pipelined_ms,
    write_rows,
)
from pallas_kernels.backend import keep_custom_calls_out_of_cuda_graphs
from pallas_kernels.ssd import BlockSizes, ssd

FWD_BWD = [(8, 2048, 24, 64, 128), (2, 8192, 80, 64, 128)]
FWD_FP32 = [(1, 2048, 24, 64, 128)]
CHUNK = 256


def make_inputs(b, l, h, p, n, dtype, seed=0):
    """Numpy inputs like a Mamba-2 layer's: softplus'd dt, A = -exp(.), one group."""
    rng = np.random.default_rng(seed)
    normal = lambda *s: rng.standard_normal(s, np.float32)  # noqa: E731
    return dict(
        x=normal(b, l, h, p).astype(dtype),
        dt=np.log1p(np.exp(normal(b, l, h) - 3.0)),
        A=-np.exp(rng.uniform(0.0, np.log(16.0), h)).astype(np.float32),
        B=normal(b, l, 1, n).astype(dtype),
        C=normal(b, l, 1, n).astype(dtype),
        D=normal(h),
        dy=normal(b, l, h, p).astype(dtype),
    )


def shape_arg(text):
    """(b, l, h, p, n) from "b,l,h,p,n": positive ints, l a multiple of the chunk."""
    try:
        shape = tuple(int(v) for v in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 5 or min(shape) < 1 or shape[1] % CHUNK:
        raise argparse.ArgumentTypeError(
            f"a shape is five positive ints b,l,h,p,n with l a multiple of {CHUNK}, got {text!r}"
        )
    return shape


def jax_case(inp, impl, backward, **kw):
    """A jitted callable: forward, or forward+backward (vjp with dy), of ssd with `impl`."""
    args = [jnp.asarray(inp[k]) for k in ("x", "dt", "A", "B", "C", "D")]
    dy = jnp.asarray(inp["dy"])

    def forward(x, dt, A, B, C, D):
        return ssd(x, dt, A, B, C, D=D, chunk_size=CHUNK, impl=impl, **kw)

    return jax_callable(forward, args, dy if backward else None)


def torch_case(inp, backward, peer_fn):
    """The same computation with mamba_chunk_scan_combined (grads of x, dt, A, B, C, D)."""
    import torch

    def t(name, dtype=None):
        """inp[name] on the GPU (bf16 arrays go through fp32: exact), a leaf if backward."""
        tensor = torch.from_numpy(np.asarray(inp[name], np.float32)).cuda()
        return tensor.to(dtype or tensor.dtype).requires_grad_(backward and name != "dy")

    bf = torch.bfloat16 if inp["x"].dtype != np.float32 else torch.float32
    x, B, C, dy = t("x", bf), t("B", bf), t("C", bf), t("dy", bf)
    dt, A, D = t("dt"), t("A"), t("D")

    def run():
        y = peer_fn(x, dt, A, B, C, CHUNK, D=D)
        if backward:
            return torch.autograd.grad(y, (x, dt, A, B, C, D), dy)
        return y

    return run


def main():
    """Runs every case, prints one JSON line per case, optionally writes them all to --json."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--peer", default=None, help="mamba_ssm checkout (see bench/mamba_ssm_peer.py)"
    )
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument(
        "--config", nargs="+", default=["default:"], help="name:BlockSizes fields, e.g. a:tile=32"
    )
    parser.add_argument("--cases", nargs="+", default=["fwd_bwd", "fwd", "fwd_fp32"])
    parser.add_argument("--profile", action="store_true", help="per-kernel GPU times too")
    parser.add_argument("--shapes", nargs="+", type=shape_arg, default=FWD_BWD, help="b,l,h,p,n")
    parser.add_argument("--no-chunked", action="store_true", help="skip the pure-JAX path")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    jax_sync = lambda out: jax.block_until_ready(out)  # noqa: E731
    peer_fn = None
    if args.peer:
        import torch

        from bench.mamba_ssm_peer import triton_ssd

        peer_fn = triton_ssd(args.peer)
        torch_sync = lambda out: torch.cuda.synchronize()  # noqa: E731

    import ml_dtypes

    bf16 = ml_dtypes.bfloat16
    cases = {
        "fwd_bwd": [(s, True, bf16) for s in args.shapes],
        "fwd": [(s, False, bf16) for s in args.shapes],
        "fwd_fp32": [(s, False, np.float32) for s in FWD_FP32],
    }
    rows = []
    for shape, backward, dtype in [case for name in args.cases for case in cases[name]]:
        inp = make_inputs(*shape, dtype)
        row = dict(shape=shape, backward=backward, dtype=np.dtype(dtype).name)
        for config in args.config:
            name, kw = parse_config(config)
            fn = jax_case(inp, "pallas", backward, block_sizes=BlockSizes(**kw))
            try:
                row[f"pallas_{name}_ms"] = median_ms(fn, args.reps, jax_sync)
                row[f"pipelined_{name}_ms"] = pipelined_ms(fn, args.reps, jax_sync)
            except (ValueError, jax.errors.JaxRuntimeError) as err:  # a bad config for the shape
                row[f"error_{name}"] = str(err).splitlines()[0]
                continue
            if args.profile:
                row[f"kernels_{name}_us"] = kernel_summary_us(fn)
        if not args.no_chunked:
            row["chunked_ms"] = median_ms(jax_case(inp, "chunked", backward), args.reps, jax_sync)
        if peer_fn is not None:
            fn = torch_case(inp, backward, peer_fn)
            row["mamba_ssm_ms"] = median_ms(fn, args.reps, torch_sync)
            row["pipelined_mamba_ssm_ms"] = pipelined_ms(fn, args.reps, torch_sync)
        compare_to_peer(row, "mamba_ssm_ms")
        emit(rows, row)
    write_rows(args.json, rows)


if __name__ == "__main__":
    # As train.py does: with custom calls kept out of CUDA graphs the default BlockSizes take the
    # Mosaic GPU chunk kernels on Hopper (kernel_mgpu.use_mosaic_gpu), as training does.
    keep_custom_calls_out_of_cuda_graphs()
    main()
