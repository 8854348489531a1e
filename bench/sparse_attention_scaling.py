"""Scaling of HAX sparse attention (lsh+ks, or --pattern) against its dense oracle: forward +
backward time and compiled peak memory as the sequence length doubles.

    JAX_PLATFORMS=cpu python bench/sparse_attention_scaling.py [--pattern P] [--write BENCHMARKS.md]

Per length: jit(value_and_grad(sum(o * w)) wrt q, k, v), warmed up once, then the median
wall time of --repeats calls; memory is the compiled executable's memory_analysis():
argument + output + temp bytes (an XLA estimate of the peak, not a measured RSS). The dense
oracle builds (l, l) masks, so it only runs while that estimate is under --dense-budget-gib.
"""

import argparse
import os
import platform
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import timing
from pallas_kernels.sparse_attention import (
    SparseSpec,
    sparse_attention,
    sparse_attention_reference,
)


def make_inputs(l, n, e, hash_bits, seed=0):
    """Random q, k, v (batch 1), hash projection, key scores and output weights."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32))  # noqa: E731
    return dict(
        q=normal(1, l, n),
        k=normal(1, l, n) / np.sqrt(n),
        v=normal(1, l, e),
        hash_proj=normal(n, hash_bits),
        key_scores=normal(1, l),
        w=normal(1, l, e),
    )


def dense_reference(q, k, v, *, pattern, num_keys, hash_proj, key_scores, binning, max_len):
    """`sparse_attention_reference` called as `sparse_attention` is (settings as keywords)."""
    hash_bits = hash_proj.shape[1]
    spec = SparseSpec(pattern, num_keys, hash_bits=hash_bits, binning=binning, max_len=max_len)
    return sparse_attention_reference(
        q, k, v, spec=spec, hash_proj=hash_proj, key_scores=key_scores
    )


def compile_fwd_bwd(fn, inputs, num_keys, pattern, max_len):
    """The compiled forward + backward of sum(o * w) for fn (sign binning; max_len: dilated's)."""

    def loss(q, k, v, hash_proj, key_scores, w):
        """Scalar loss of the attention output."""
        o = fn(
            q,
            k,
            v,
            pattern=pattern,
            num_keys=num_keys,
            hash_proj=hash_proj,
            key_scores=key_scores,
            binning="sign",
            max_len=max_len,
        )
        return jnp.sum(o * w)

    grad_fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    names = ("q", "k", "v", "hash_proj", "key_scores", "w")
    return grad_fn.lower(*(inputs[name] for name in names)).compile(), names


def peak_bytes(compiled):
    """argument + output + temp bytes of a compiled executable (XLA's estimate)."""
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes


def measure(fn, l, args, budget_bytes=None):
    """(median seconds or None if over budget, peak bytes) of forward + backward at length l."""
    inputs = make_inputs(l, args.n, args.e, args.hash_bits)
    max_len = args.max_len or l  # dilated: a key every max_len // kc positions
    compiled, names = compile_fwd_bwd(fn, inputs, args.num_keys, args.pattern, max_len)
    peak = peak_bytes(compiled)
    if budget_bytes is not None and peak > budget_bytes:
        return None, peak
    call = lambda: jax.block_until_ready(compiled(*(inputs[name] for name in names)))  # noqa: E731
    call()  # warm-up
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times), peak


def ratio(cur, prev):
    """cur / prev formatted, or a dash."""
    return f"{cur / prev:.2f}x" if cur is not None and prev else "—"


def table(rows, pattern):
    """Markdown table of the measurements with per-doubling growth ratios."""
    lines = [
        f"| l | {pattern} time (ms) | x prev | {pattern} peak (MiB) | x prev "
        "| dense time (ms) | x prev | dense peak (MiB) | x prev |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    prev = None
    for row in rows:
        cells = [f"{row['l']}"]
        for kind in ("sparse", "dense"):
            t, mem = row[kind]
            pt, pmem = prev[kind] if prev else (None, None)
            cells += [
                "—" if t is None else f"{t * 1e3:.2f}",
                ratio(t, pt),
                "—" if mem is None else f"{mem / 2**20:.1f}",
                ratio(mem, pmem),
            ]
        lines.append("| " + " | ".join(cells) + " |")
        prev = row
    return "\n".join(lines)


def heading(pattern="lsh+ks"):
    """The section heading names the backend (and a pattern other than lsh+ks), so CPU and GPU
    sections, and the patterns', live side by side."""
    which = "" if pattern == "lsh+ks" else f", {pattern}"
    return f"## sparse_attention scaling{which} ({jax.default_backend().upper()})"


def machine():
    """What ran it: the accelerator's kind, or the CPU."""
    device = jax.devices()[0]
    where = f"{device.device_kind}" if device.platform != "cpu" else "CPU only, no accelerator"
    return (
        f"Machine: {where}; {os.cpu_count()} CPU cores ({platform.machine()}), "
        f"jax {jax.__version__}, backend {jax.default_backend()}."
    )


def section(rows, args):
    """The BENCHMARKS.md section: setup, table, notes."""
    return "\n".join(
        [
            heading(args.pattern),
            "",
            machine(),
            f"Command: `python bench/sparse_attention_scaling.py {' '.join(sys.argv[1:])}`",
            "",
            f"Forward + backward (jit(value_and_grad) wrt q, k, v) of one head, batch 1, "
            f"n = {args.n}, e = {args.e}, num_keys = {args.num_keys}, pattern `{args.pattern}`, "
            f"sign binning with h = {args.hash_bits} ({2**args.hash_bits} buckets). Time: "
            f"median of {args.repeats} runs "
            "after one warm-up. Peak: the compiled executable's `memory_analysis()`, argument + "
            "output + temp bytes (XLA's estimate, not a measured RSS). "
            "`dense` is the O(l^2) oracle "
            "`sparse_attention_reference` (same pattern); its time is left out (—) where the "
            f"estimate exceeds {args.dense_budget_gib} GiB, and it is not compiled past "
            f"l = {args.dense_max}. `x prev` is the growth over the previous (half as long) row: "
            "about 2x means linear, about 4x quadratic.",
            "",
            table(rows, args.pattern),
            "",
        ]
    )


def write_section(path, text, heading_text):
    """Replace (or append) the section headed `heading_text` of the markdown file at path."""
    old = open(path).read() if os.path.exists(path) else "# Benchmarks\n\n"
    pattern = re.compile(re.escape(heading_text) + r"\n.*?(?=^## |\Z)", re.S | re.M)
    new = (
        pattern.sub(lambda _: text + "\n", old)
        if pattern.search(old)
        else (old.rstrip("\n") + "\n\n" + text)
    )
    with open(path, "w") as f:
        f.write(new)


def main():
    """Run the sweep, print the table, optionally write it into BENCHMARKS.md."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768]
    )
    parser.add_argument("--dense-max", type=int, default=16384)
    parser.add_argument("--dense-budget-gib", type=float, default=12.0)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--e", type=int, default=128)
    parser.add_argument("--num-keys", type=int, default=64)
    parser.add_argument("--pattern", default="lsh+ks", help="the sparse pattern timed")
    parser.add_argument(
        "--max-len", type=int, default=0, help="dilated's max_len (0: each row's length l)"
    )
    parser.add_argument("--hash-bits", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--write", metavar="PATH", help="markdown file to put the section in")
    args = parser.parse_args()
    timing.check_sizes(parser, args, zero_ok=("dense_max", "max_len"))
    rows = []
    for l in args.lengths:
        try:
            sparse = measure(sparse_attention, l, args)
        except ValueError as err:  # the op's own check of the sizes, e.g. num_keys
            parser.error(str(err))
        dense = (None, None)
        if l <= args.dense_max:
            dense = measure(dense_reference, l, args, budget_bytes=args.dense_budget_gib * 2**30)
        rows.append(dict(l=l, sparse=sparse, dense=dense))
        print(f"l={l}: sparse {sparse}, dense {dense}", file=sys.stderr, flush=True)
    text = section(rows, args)
    print(text)
    if args.write:
        write_section(args.write, text, heading(args.pattern))


if __name__ == "__main__":
    main()
