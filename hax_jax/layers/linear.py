"""The linear layer the mixers build (nnx.Linear, kernel (in, out)) and its decode-time copy.

A one-row matmul (decoding at batch 1) over a kernel stored (in, out) reads it column by column.
XLA on an H200 made it a multiply and a column reduction (Mamba-2 130M's in_proj and out_proj: 320
of the 714 us of a token's kernels); 24 layers' two GEMVs took 342 us a token so against 131 us
with the kernels stored (out, in) (`python bench/decode_gemv_layout.py`, one H200), and generate
decoded Mamba-2 130M 1.35x faster at batch 1 (BENCHMARKS.md). So before its loop,
`generate` makes each kernel's copy rows first (`decode_copy`), in a program of its own: an
argument's layout is fixed, where a copy made inside the decode program could be laid back out by
XLA. Training never makes one.
"""

import jax
from flax import nnx


class Linear(nnx.Linear):
    """nnx.Linear that, once given its `decode_copy`, reads the copy instead of its kernel."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.decoding = nnx.data(None)  # (kernel (out, in), bias) in the compute dtype

    def decode_copy(self) -> tuple[jax.Array, jax.Array | None]:
        """(the kernel rows first, the bias), in the dtype __call__ computes in."""
        bias = None if self.bias is None else self.bias[...]
        kernel, bias = self.promote_dtype((self.kernel[...], bias), dtype=self.dtype)
        return rows_first(kernel), bias

    def rows(self) -> tuple[jax.Array, jax.Array | None]:
        """(the kernel rows first, the bias) as __call__ reads them: the decode copy if one is
        given, else made from the kernel now."""
        return self.decode_copy() if self.decoding is None else self.decoding

    def __call__(self, x: jax.Array, out_sharding=None) -> jax.Array:
        if self.decoding is None:
            return super().__call__(x, out_sharding)
        rows, bias = self.decoding
        x, rows, bias = self.promote_dtype((x, rows, bias), dtype=self.dtype)
        return rows_matmul(x, rows, bias)


def rows_first(kernel: jax.Array) -> jax.Array:
    """kernel (in, out) -> (out, in)."""
    return kernel.T


def rows_matmul(x: jax.Array, rows: jax.Array, bias: jax.Array | None) -> jax.Array:
    """x (..., in) @ rows (out, in).T + bias: nnx.Linear's arithmetic on a kernel stored rows
    first (the dtypes already promoted)."""
    y = jax.lax.dot_general(x, rows, (((x.ndim - 1,), (1,)), ((), ())))
    return y if bias is None else y + bias
