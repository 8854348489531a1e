"""Tile-level pieces shared by the SSD kernels (forward: kernel.py, backward: grad_kernels.py):
fp32-accumulating matmuls, the causal / same-document mask, masked decays, position vectors, and
a view of one head of a block of heads."""

import jax
import jax.numpy as jnp

F32 = jnp.float32


def dot(a, b, *, trans_a=False, trans_b=False):
    """a @ b with optional transposes, fp32 accumulation."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=F32)


def causal_keep(seq_a, seq_b, pos_a, pos_b):
    """Pairs (a, b) with b <= a in the same document: where L is nonzero."""
    return (pos_b <= pos_a) & (seq_a == seq_b)


def masked_exp(keep, log_value):
    """exp(log_value) where keep else 0; exp never sees the masked (possibly huge) values."""
    return jnp.where(keep, jnp.exp(jnp.where(keep, log_value, 0.0)), 0.0)


def positions(start, n, as_row):
    """Chunk positions start..start+n-1 as an (n, 1) column or a (1, n) row."""
    shape = (1, n) if as_row else (n, 1)
    return start + jax.lax.broadcasted_iota(jnp.int32, shape, 1 if as_row else 0)


class Head:
    """Head hh of a ref that holds a block of heads on `axis`, indexed like a ref of one head.
    (Triton lowers one indexer per load or store: `ref.at[hh][rows]` views cannot be used.)"""

    def __init__(self, ref, hh, axis=0):
        self.ref, self.hh, self.axis = ref, hh, axis
        self.dtype = ref.dtype
        self.shape = tuple(d for a, d in enumerate(ref.shape) if a != axis)

    def _index(self, idx):
        idx = [] if idx is Ellipsis else list(idx if isinstance(idx, tuple) else (idx,))
        idx += [slice(None)] * (len(self.shape) - len(idx))
        idx.insert(self.axis, self.hh)
        return tuple(idx)

    def __getitem__(self, idx):
        return self.ref[self._index(idx)]

    def __setitem__(self, idx, value):
        self.ref[self._index(idx)] = value


def head(ref, hh, seq_major):
    """Head hh of an x-like block: (k, heads, f) when seq_major (gpu), else (heads, k, f)."""
    return Head(ref, hh, 1 if seq_major else 0)
