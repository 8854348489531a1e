"""A decode token's one-row matmuls by kernel layout: `--layers` layers, each an in_proj and an
out_proj GEMV (bf16, batch 1, Mamba-2 130M's shapes by default), a token a step of a fori_loop, the
kernels stored (in, out) as nnx.Linear keeps them or (out, in) as generate's decode copies
(hax_jax.layers.linear), with the layers unrolled (as LanguageModel.step) or scanned.

    python bench/decode_gemv_layout.py [--layers 24] [--d-model 768] [--in-proj 3352]
        [--d-inner 1536] [--tokens 256]

Prints one JSON line per layout: microseconds a token, best of 3 (the loop's own overhead included,
so only the rows' differences are the layouts').
"""

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import timing


def _matmul(x, kernel, rows_first: bool):
    contract = 1 if rows_first else 0
    return jax.lax.dot_general(x, kernel, (((1,), (contract,)), ((), ())))


def token_us(args, rows_first: bool, unrolled: bool) -> float:
    d, n_in, n_out = args.d_model, args.in_proj, args.d_inner
    keys = jax.random.split(jax.random.key(0), 2)
    in_shape, out_shape = ((n_in, d), (d, n_out)) if rows_first else ((d, n_in), (n_out, d))
    w_in = jax.random.normal(keys[0], (args.layers, *in_shape), jnp.bfloat16) * 0.02
    w_out = jax.random.normal(keys[1], (args.layers, *out_shape), jnp.bfloat16) * 0.02

    def layer(x, kernels):
        h = _matmul(x, kernels[0], rows_first)
        return x + 1e-3 * _matmul(h[:, :n_out], kernels[1], rows_first), None

    # The kernels are the program's arguments, as generate's parameters are: an argument's layout
    # is fixed, where a constant closed over would be laid out by XLA as it likes (and the two
    # layouts then time the same).
    def tokens(w_in, w_out):
        def token(_, x):
            if not unrolled:
                return jax.lax.scan(layer, x, (w_in, w_out))[0]
            for i in range(args.layers):
                x = layer(x, (w_in[i], w_out[i]))[0]
            return x

        return jax.lax.fori_loop(0, args.tokens, token, jnp.ones((1, d), jnp.bfloat16))

    run = functools.partial(jax.jit(tokens), w_in, w_out)
    run().block_until_ready()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        run().block_until_ready()
        best = min(best, time.perf_counter() - start)
    return best / args.tokens * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--in-proj", type=int, default=3352, help="in_proj's output width")
    parser.add_argument("--d-inner", type=int, default=1536, help="out_proj's input width")
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    timing.check_sizes(parser, args)
    if args.d_inner > args.in_proj:
        parser.error(f"--d-inner {args.d_inner} is wider than --in-proj {args.in_proj}")
    print(json.dumps({"device": jax.devices()[0].device_kind, "jax": jax.__version__}))
    for unrolled in (True, False):
        for rows_first in (False, True):
            us = token_us(args, rows_first, unrolled)
            layout = "(out, in)" if rows_first else "(in, out)"
            loop = "unrolled" if unrolled else "scanned"
            print(json.dumps({"kernels": layout, "layers": loop, "us_per_token": round(us, 2)}))


if __name__ == "__main__":
    main()
