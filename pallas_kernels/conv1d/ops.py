"""The causal conv's Triton kernels as a differentiable op (the definition and its pure-JAX path:
hax_jax/layers/conv.py `causal_conv1d`)."""

import functools

import jax
import jax.numpy as jnp

from . import kernel as conv_kernel
from .kernel import ROWS


def supports(l: int, k: int) -> bool:
    """Whether the kernels take rows of `l` with a `k`-tap kernel: whole T-row chunks, and the
    window within one chunk."""
    return l % ROWS == 0 and 1 <= k <= ROWS


def causal_conv1d_pallas(
    x, kernel, bias, state, seq_idx=None, state_seq_idx=None, *, silu=False, interpret=None
):
    """y (b, l, c) in x's dtype: bias + sum_j kernel[j] x_{t-(k-1)+j} over [state | x], taps
    across documents zeroed, and with `silu` its SiLU (in fp32, rounded once). l a multiple of
    ROWS (`supports`)."""
    b, l, c = x.shape
    k = kernel.shape[0]
    if not supports(l, k):
        raise ValueError(
            f"the conv kernels need l a multiple of {ROWS} and k <= {ROWS}; got l={l}, k={k}"
        )
    docs = None
    if seq_idx is not None:
        docs = (seq_idx.astype(jnp.int32), state_seq_idx.astype(jnp.int32))
    return _conv(x, kernel, bias, state.astype(x.dtype), docs, silu, interpret)


def _head(state, x, fill=0):
    """[state | x's first ROWS rows | fill] (b, 2 ROWS, ...): the first chunk's earlier rows."""
    k1 = state.shape[1]
    pad = [(0, 0), (0, ROWS - k1)] + [(0, 0)] * (x.ndim - 2)
    return jnp.pad(jnp.concatenate([state, x[:, :ROWS]], axis=1), pad, constant_values=fill)


def _tail(x, fill=0):
    """[x's last ROWS rows | fill] (b, 2 ROWS, ...): what the last chunk's gradient reads after."""
    pad = [(0, 0), (0, ROWS)] + [(0, 0)] * (x.ndim - 2)
    return jnp.pad(x[:, x.shape[1] - ROWS :], pad, constant_values=fill)


def _forward(x, kernel, bias, state, docs, silu, interpret):
    seq = head_seq = None
    if docs is not None:
        seq, state_seq = docs
        head_seq = _head(state_seq, seq, fill=-1)
    activation = "silu" if silu else None
    return conv_kernel.forward(
        x, kernel, bias, _head(state, x), seq, head_seq, activation=activation, interpret=interpret
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _conv(x, kernel, bias, state, docs, silu, interpret):
    return _forward(x, kernel, bias, state, docs, silu, interpret)


def _conv_fwd(x, kernel, bias, state, docs, silu, interpret):
    # Saved: the inputs only; the backward recomputes the SiLU's slope. Keeping the conv's
    # output for it, with the SiLU left to XLA, cost 5.4 GiB at Mamba-2 130M, 32 x 2048 (H200).
    y = _forward(x, kernel, bias, state, docs, silu, interpret)
    return y, (x, kernel, bias, state, docs)


def _conv_bwd(silu, interpret, residuals, dy):
    x, kernel, bias, state, docs = residuals
    k = kernel.shape[0]
    seq = head_seq = tail_seq = None
    head = _head(state, x)
    if docs is not None:
        seq, state_seq = docs
        head_seq, tail_seq = _head(state_seq, seq, fill=-1), _tail(seq, fill=-1)
    if silu:
        # The pre-activation's gradient (in dy's dtype) and the kernel's and bias's from it in
        # fp32, in one pass like the forward's; then dx alone.
        g, sums = conv_kernel.forward(
            x, kernel, bias, head, seq, head_seq, activation="silu_grad", g=dy, interpret=interpret
        )
        dx, _ = conv_kernel.backward(
            g, _tail(g), kernel, seq=seq, head_seq=head_seq, tail_seq=tail_seq, interpret=interpret
        )
    else:
        g = dy
        dx, sums = conv_kernel.backward(
            g, _tail(g), kernel, x, head, seq, head_seq, tail_seq, interpret=interpret
        )
    sums = jnp.sum(sums, axis=(0, 1))  # (k + 1, c)
    # State row i is tap j of output i - j (k - 1 rows: summed here).
    g = g[:, : k - 1].astype(jnp.float32)
    rows = []
    for i in range(k - 1):
        row = jnp.zeros((x.shape[0], x.shape[2]), jnp.float32)
        for j in range(i + 1):
            term = g[:, i - j] * kernel[j].astype(jnp.float32)
            if docs is not None:
                term = jnp.where((docs[1][:, i] == docs[0][:, i - j])[:, None], term, 0.0)
            row = row + term
        rows.append(row)
    dstate = jnp.stack(rows, axis=1) if rows else jnp.zeros_like(state, jnp.float32)
    dbias = None if bias is None else sums[k].astype(bias.dtype)
    return dx, sums[:k].astype(kernel.dtype), dbias, dstate.astype(state.dtype), None


_conv.defvjp(_conv_fwd, _conv_bwd)
