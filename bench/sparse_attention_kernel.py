"""Pallas HAX sparse attention (impl="pallas", lsh+ks) against cuDNN dense causal attention:
forward + backward time as the sequence length doubles.

    python bench/sparse_attention_kernel.py [--lengths 8192 16384 ...] [--json out.json]
    JAX_PLATFORMS=cpu python bench/sparse_attention_kernel.py --lengths 256 512 --repeats 1

Per length: jit(value_and_grad(sum(o)) wrt q, k, v), warmed up once, then the median wall time
of --repeats calls (block_until_ready). HAX: one head, batch 1, n = 16, e = 1536, num_keys 64,
sign binning with h = 8, bf16. Dense: `jax.nn.dot_product_attention(is_causal=True,
implementation="cudnn")` with 24 heads of 64 (the same d_inner), bf16, up to --dense-max; only
on a GPU (off-GPU the Pallas kernels run interpreted: a smoke check, not a timing).
"""

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import timing
from pallas_kernels.sparse_attention import sparse_attention

BF16 = jnp.bfloat16


def median_ms(fn, args, repeats):
    """Median wall time (ms) of fn(*args) over `repeats` calls after one warm-up."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def sum_grads(attend):
    """jit(value_and_grad(sum(attend(q, k, v, *rest))) wrt q, k, v)."""

    def loss(q, k, v, *rest):
        return jnp.sum(attend(q, k, v, *rest).astype(jnp.float32))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def pallas_ms(l, args, rng):
    """Forward + backward of the Pallas op at length l."""
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32))  # noqa: E731
    q, k = normal(1, l, args.n).astype(BF16), (normal(1, l, args.n) / args.n**0.5).astype(BF16)
    v = normal(1, l, args.e).astype(BF16)
    hash_proj, key_scores = normal(args.n, args.hash_bits), normal(1, l)

    def attend(q, k, v, hash_proj, key_scores):
        return sparse_attention(
            q,
            k,
            v,
            pattern="lsh+ks",
            num_keys=args.num_keys,
            hash_proj=hash_proj,
            key_scores=key_scores,
            binning="sign",
            impl="pallas",
            block_q=args.block_q,
            block_k=args.block_k,
            block_e=args.block_e,
            num_warps=args.num_warps,
            num_stages=args.num_stages,
        )

    return median_ms(sum_grads(attend), (q, k, v, hash_proj, key_scores), args.repeats)


def cudnn_ms(l, args, rng):
    """Forward + backward of cuDNN dense causal attention, 24 heads of 64, at length l."""
    shape = (1, l, args.dense_heads, args.e // args.dense_heads)
    q, k, v = (jnp.asarray(rng.standard_normal(shape, np.float32), BF16) for _ in range(3))

    def attend(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    return median_ms(sum_grads(attend), (q, k, v), args.repeats)


def table(rows):
    """Markdown table: l, Pallas ms, growth over the previous row, cuDNN ms, cuDNN / Pallas."""
    lines = [
        "| l | pallas (ms) | x prev | cudnn (ms) | cudnn / pallas |",
        "|---:|---:|---:|---:|---:|",
    ]
    prev = None
    for row in rows:
        ours, dense = row["pallas_ms"], row["cudnn_ms"]
        growth = f"{ours / prev:.2f}x" if prev else "—"
        dense_cells = ["—", "—"] if dense is None else [f"{dense:.3f}", f"{dense / ours:.1f}x"]
        lines.append(f"| {row['l']} | {ours:.3f} | {growth} | " + " | ".join(dense_cells) + " |")
        prev = ours
    return "\n".join(lines)


def main():
    """Sweep the lengths, print the table, optionally write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2**p for p in range(13, 21)])
    parser.add_argument("--dense-max", type=int, default=65536)
    parser.add_argument("--dense-heads", type=int, default=24)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--e", type=int, default=1536)
    parser.add_argument("--num-keys", type=int, default=64)
    parser.add_argument("--hash-bits", type=int, default=8)
    parser.add_argument("--block-q", type=int, default=64)
    parser.add_argument("--block-k", type=int, default=64)
    parser.add_argument("--block-e", type=int, default=128)
    parser.add_argument("--num-warps", type=int, default=4)
    parser.add_argument("--num-stages", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", metavar="PATH", help="write the rows and settings here")
    args = parser.parse_args()
    timing.check_sizes(parser, args, zero_ok=("dense_max",))
    on_gpu = jax.default_backend() == "gpu"
    rng = np.random.default_rng(0)
    rows = []
    for l in args.lengths:
        try:
            ours = pallas_ms(l, args, rng)
        except ValueError as err:  # the op's own check of the sizes and blocks
            parser.error(str(err))
        dense = cudnn_ms(l, args, rng) if on_gpu and l <= args.dense_max else None
        rows.append(dict(l=l, pallas_ms=ours, cudnn_ms=dense))
        print(f"l={l}: pallas {ours:.3f} ms, cudnn {dense} ms", file=sys.stderr, flush=True)
    device = jax.devices()[0]
    print(f"{device.device_kind} ({jax.default_backend()}), jax {jax.__version__}")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device.device_kind, settings=vars(args), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
