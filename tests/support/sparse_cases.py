"""Shared cases of the sparse-attention tests (test_sparse_attention.py, test_sparse_decode.py):
tolerances, sizes, the patterns, random inputs and the jitted forward + vjp probe."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.sparse_attention import SparseSpec, sparse_attention_mask

# Forward and gradient tolerances, per input dtype. bf16: outputs are rounded to bf16 once.
TOL = {jnp.float32: dict(atol=1e-5, rtol=1e-5), jnp.bfloat16: dict(atol=1e-2, rtol=1e-2)}
GRAD_TOL = dict(atol=1e-5, rtol=1e-4)

B_, N_, E_, H_ = 2, 8, 6, 3
MAX_LEN = 40  # dilated: d = max(1, 40 // kc)
# (pattern, binning); binning only matters with lsh. The last is a 3-way union.
CASES = [
    ("sw", "sign"),
    ("sink", "sign"),
    ("dilated", "sign"),
    ("lsh", "sign"),
    ("lsh", "argmax"),
    ("ks", "sign"),
    ("full", "sign"),
    ("sw+sink", "sign"),
    ("sw+dilated", "sign"),
    ("lsh+ks", "sign"),
    ("lsh+ks", "argmax"),
    ("sw+lsh+ks", "sign"),
]
CASE_IDS = [f"{p}-{b}" if "lsh" in p else p for p, b in CASES]


def make_inputs(l, seed=0, dtype=jnp.float32, hash_bits=H_, b=B_, n=N_, e=E_):
    """Random q, k, v, hash_proj; key_scores are small integers, so ks sees many ties."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape, np.float32)  # noqa: E731
    return dict(
        q=jnp.asarray(normal(b, l, n), dtype),
        k=jnp.asarray(normal(b, l, n), dtype),
        v=jnp.asarray(normal(b, l, e), dtype),
        hash_proj=jnp.asarray(normal(n, hash_bits)),
        key_scores=jnp.asarray(rng.integers(0, 6, (b, l)).astype(np.float32), dtype),
    )


def spec_of(pattern, num_keys, binning="sign", hash_bits=H_):
    """The SparseSpec of a test case (max_len = MAX_LEN for dilated)."""
    return SparseSpec(pattern, num_keys, hash_bits=hash_bits, binning=binning, max_len=MAX_LEN)


def assert_close(actual, desired, tol):
    """assert_allclose on fp32 copies."""
    actual, desired = np.asarray(actual, np.float32), np.asarray(desired, np.float32)
    np.testing.assert_allclose(actual, desired, **tol)


@functools.partial(jax.jit, static_argnames=("fn", "with_rows", "spec"))
def _probe(q, k, v, rest, w, *, fn, with_rows, spec):
    """Forward, one vjp and (with_rows) the l one-hot vjps; see `probe`."""
    o, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, **rest, spec=spec).astype(jnp.float32), q, k, v)
    grads = dict(zip("qkv", vjp(w)))
    if not with_rows:
        mask = sparse_attention_mask(q, k, **rest, spec=spec)
        return o, grads, mask
    b, l, e = o.shape
    onehot_ibl1 = jnp.eye(l, dtype=jnp.float32)[:, None, :, None]
    rows = jax.vmap(vjp)(jnp.broadcast_to(onehot_ibl1, (l, b, l, e)))
    return o, grads, dict(zip("qkv", rows))


def probe(fn, inputs, with_rows, spec):
    """(o, grads of a fixed random linear functional of o wrt q, k, v, extra), jitted once per
    (fn, shapes, spec).

    extra: with_rows, rows[name][i] = d sum(o[:, i]) / d name of shape (l, b, l, feature), the
    gradient of query row i at every position (causality, empty rows); else the oracle's mask.
    """
    rest = {name: x for name, x in inputs.items() if name not in ("q", "k", "v")}
    w = jnp.asarray(np.random.default_rng(9).standard_normal(inputs["v"].shape), jnp.float32)
    return _probe(
        inputs["q"],
        inputs["k"],
        inputs["v"],
        rest,
        w,
        fn=fn,
        with_rows=with_rows,
        spec=spec,
    )
