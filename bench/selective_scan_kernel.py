"""Selective scan forward+backward: our Pallas kernel vs the associative scan vs mamba_ssm's CUDA.

    python bench/selective_scan_kernel.py [--peer .peer --build-dir DIR] [--json out.json]
        [--config name:key=value,key=value ...]

Cases (issue #6): (b8, l2048, d1536, n16) and (b2, l8192, d5120, n16); x, dt, z, B, C bf16, A, D
fp32 (a Mamba-1 layer's scan: D skip and z gate included, dt already positive); forward+backward
(grads of x, dt, A, B, C, D, z for a random cotangent) and forward alone. The peer is
`selective_scan_fn` over mamba_ssm's CUDA kernels (bench/mamba_ssm_peer.py) on the same values in
its (b, d, l) layout. Medians of --reps synchronised runs after two warm-ups; `pipelined_*`:
means over --reps back-to-back calls synchronised once (bench/timing.py).
"""

import argparse

import jax
import jax.numpy as jnp
import ml_dtypes
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
from pallas_kernels.selective_scan import BlockSizes, selective_scan

SHAPES = [(8, 2048, 1536, 16), (2, 8192, 5120, 16)]
NAMES = ("x", "dt", "A", "B", "C", "D", "z")


def make_inputs(b, l, d, n, seed=0):
    """A Mamba-1 layer's scan inputs: softplus'd dt, A = -(1..n) (S4D-real init)."""
    rng = np.random.default_rng(seed)
    normal = lambda *s: rng.standard_normal(s, np.float32)  # noqa: E731
    bf16 = ml_dtypes.bfloat16
    return dict(
        x=normal(b, l, d).astype(bf16),
        dt=np.log1p(np.exp(normal(b, l, d) - 3.0)).astype(bf16),
        A=-np.broadcast_to(np.arange(1, n + 1, dtype=np.float32), (d, n)).copy(),
        B=normal(b, l, n).astype(bf16),
        C=normal(b, l, n).astype(bf16),
        D=normal(d),
        z=normal(b, l, d).astype(bf16),
        dy=normal(b, l, d).astype(bf16),
    )


def jax_case(inp, backward, impl, **kw):
    """A callable running our op (forward, or forward + vjp)."""
    args = [jnp.asarray(inp[k]) for k in NAMES]
    dy = jnp.asarray(inp["dy"])

    def forward(x, dt, A, B, C, D, z):
        return selective_scan(x, dt, A, B, C, D=D, z=z, impl=impl, **kw)

    return jax_callable(forward, args, dy if backward else None)


def torch_case(inp, backward, peer_fn):
    """The same scan with mamba_ssm's selective_scan_fn, (b, d, l) layout."""
    import torch

    def t(name, transpose):
        tensor = torch.from_numpy(np.asarray(inp[name], np.float32)).cuda()
        if inp[name].dtype != np.float32:
            tensor = tensor.to(torch.bfloat16)
        if transpose:
            tensor = tensor.transpose(1, 2).contiguous()
        return tensor.requires_grad_(backward and name != "dy")

    x, dt, B, C, z, dy = (t(k, True) for k in ("x", "dt", "B", "C", "z", "dy"))
    A, D = t("A", False), t("D", False)

    def run():
        y = peer_fn(x, dt, A, B, C, D, z, None, False)
        return torch.autograd.grad(y, (x, dt, A, B, C, D, z), dy) if backward else y

    return run


def main():
    """Runs every case, prints one JSON line per case, optionally writes all to --json."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", default=None, help="mamba_ssm checkout (bench/mamba_ssm_peer.py)")
    parser.add_argument("--build-dir", default=".peer/build")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument(
        "--config", nargs="+", default=["default:"], help="name:BlockSizes fields, e.g. a:chunk=8"
    )
    parser.add_argument("--no-associative", action="store_true")
    parser.add_argument("--modes", nargs="+", default=["fwd_bwd", "fwd"])
    parser.add_argument("--profile", action="store_true", help="per-kernel GPU times too")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    jax_sync = jax.block_until_ready
    peer_fn = None
    if args.peer:
        import torch

        from bench.mamba_ssm_peer import cuda_selective_scan

        peer_fn = cuda_selective_scan(args.peer, args.build_dir)
        torch_sync = lambda out: torch.cuda.synchronize()  # noqa: E731
    rows = []
    for backward in [mode == "fwd_bwd" for mode in args.modes]:
        for shape in SHAPES:
            inp = make_inputs(*shape)
            row = dict(shape=shape, backward=backward)
            for config in args.config:
                name, kw = parse_config(config)
                blocks = BlockSizes(**kw) if kw else None
                fn = jax_case(inp, backward, "pallas", block_sizes=blocks)
                row[f"pallas_{name}_ms"] = median_ms(fn, args.reps, jax_sync)
                row[f"pipelined_{name}_ms"] = pipelined_ms(fn, args.reps, jax_sync)
                if args.profile:
                    row[f"kernels_{name}_us"] = kernel_summary_us(fn)
            if not args.no_associative:
                fn = jax_case(inp, backward, "associative")
                row["associative_ms"] = median_ms(fn, args.reps, jax_sync)
            if peer_fn is not None:
                fn = torch_case(inp, backward, peer_fn)
                row["mamba_ssm_cuda_ms"] = median_ms(fn, args.reps, torch_sync)
                row["pipelined_mamba_ssm_cuda_ms"] = pipelined_ms(fn, args.reps, torch_sync)
            compare_to_peer(row, "mamba_ssm_cuda_ms")
            emit(rows, row)
    write_rows(args.json, rows)


if __name__ == "__main__":
    main()
