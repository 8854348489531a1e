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
    x,
    kernel,
    bias,
    state,
    seq_idx=None,
    state_seq_idx=None,
    *,
    silu=False,
    start=0,
    parts=None,
    interpret=None,
):
    """y (b, l, c), c = kernel.shape[1], in x's dtype: bias + sum_j kernel[j] x_{t-(k-1)+j} over
    [state | x's channels start .. start + c], taps across documents zeroed, and with `silu` its
    SiLU (in fp32, rounded once). x may be wider than the conv (a projection's whole output): it
    is read in place, not sliced into a copy. parts: widths summing to c, y then a tuple of those
    arrays, each written apart (no slices copied by the caller). l a multiple of ROWS
    (`supports`)."""
    b, l, width = x.shape
    k, c = kernel.shape
    if jax.default_backend() == "tpu":
        raise ValueError("conv impl 'pallas' has Triton (GPU) kernels only; on a TPU use 'auto'")
    if not supports(l, k):
        raise ValueError(
            f"conv impl 'pallas': the kernels need a length that is a multiple of {ROWS} "
            f"and a width <= {ROWS}; got l={l}, k={k} (impl 'auto' uses XLA there)"
        )
    if not 0 <= start <= width - c:
        raise ValueError(f"channels {start} .. {start + c} are not all in x's {width}")
    split = parts is not None
    parts = (c,) if parts is None else tuple(parts)
    if sum(parts) != c or min(parts) < 1:
        raise ValueError(f"parts {parts} must be positive and sum to the conv's channels, {c}")
    docs = None
    if seq_idx is not None:
        docs = (seq_idx.astype(jnp.int32), state_seq_idx.astype(jnp.int32))
    y = _conv(x, kernel, bias, state.astype(x.dtype), docs, silu, start, parts, interpret)
    return y if split else y[0]


def _window(x, start, c):
    """x's channels start .. start + c."""
    return x[..., start : start + c]


def _head(state, x, fill=0):
    """[state | x's first ROWS rows | fill] (b, 2 ROWS, ...): the first chunk's earlier rows."""
    k1 = state.shape[1]
    pad = [(0, 0), (0, ROWS - k1)] + [(0, 0)] * (x.ndim - 2)
    return jnp.pad(jnp.concatenate([state, x[:, :ROWS]], axis=1), pad, constant_values=fill)


def _tail(x, fill=0):
    """[x's last ROWS rows | fill] (b, 2 ROWS, ...): what the last chunk's gradient reads after."""
    pad = [(0, 0), (0, ROWS)] + [(0, 0)] * (x.ndim - 2)
    return jnp.pad(x[:, x.shape[1] - ROWS :], pad, constant_values=fill)


def _forward(x, kernel, bias, state, docs, silu, start, parts, interpret):
    seq = head_seq = None
    if docs is not None:
        seq, state_seq = docs
        head_seq = _head(state_seq, seq, fill=-1)
    head = _head(state, _window(x[:, :ROWS], start, kernel.shape[1]))
    return conv_kernel.forward(
        x,
        kernel,
        bias,
        head,
        seq,
        head_seq,
        activation="silu" if silu else None,
        start=start,
        parts=parts,
        interpret=interpret,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _conv(x, kernel, bias, state, docs, silu, start, parts, interpret):
    return _forward(x, kernel, bias, state, docs, silu, start, parts, interpret)


def _conv_fwd(x, kernel, bias, state, docs, silu, start, parts, interpret):
    # Saved: the inputs only; the backward recomputes the SiLU's slope. Keeping the conv's
    # output for it, with the SiLU left to XLA, cost 5.4 GiB at Mamba-2 130M, 32 x 2048 (H200).
    y = _forward(x, kernel, bias, state, docs, silu, start, parts, interpret)
    return y, (x, kernel, bias, state, docs)


def _conv_bwd(silu, start, parts, interpret, residuals, dys):
    x, kernel, bias, state, docs = residuals
    k, c = kernel.shape
    seq = head_seq = tail_seq = None
    head = _head(state, _window(x[:, :ROWS], start, c))
    if docs is not None:
        seq, state_seq = docs
        head_seq, tail_seq = _head(state_seq, seq, fill=-1), _tail(seq, fill=-1)
    if silu:
        # The pre-activation's gradient (in dy's dtype) and the kernel's and bias's from it in
        # fp32, in one pass like the forward's, reading dy by parts; then dx alone. dx thus takes
        # one more rounding than XLA's conv (fp32 throughout): in bf16 its error is about 1.5x
        # XLA's, where keeping g in fp32 would write and read it at twice the bytes.
        g, sums = conv_kernel.forward(
            x,
            kernel,
            bias,
            head,
            seq,
            head_seq,
            activation="silu_grad",
            g=dys,
            start=start,
            parts=parts,
            interpret=interpret,
        )
        dx, _ = conv_kernel.backward(
            g, _tail(g), kernel, seq=seq, head_seq=head_seq, tail_seq=tail_seq, interpret=interpret
        )
    else:
        g = dys[0] if len(dys) == 1 else jnp.concatenate(dys, axis=-1)
        dx, sums = conv_kernel.backward(
            g, _tail(g), kernel, x, head, seq, head_seq, tail_seq, start=start, interpret=interpret
        )
    # x's gradient outside the conv's channels is zero: a pad XLA folds into the sum of x's
    # other cotangents (a projection's other parts).
    dx = jnp.pad(dx, [(0, 0), (0, 0), (start, x.shape[2] - start - c)])
    sums = jnp.sum(sums, axis=(0, 1))  # (k + 1, c)
    # State row i is tap j of output i - j (k - 1 rows: summed here).
    g = g[:, : k - 1].astype(jnp.float32)
    rows = []
    for i in range(k - 1):
        row = jnp.zeros((x.shape[0], c), jnp.float32)
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
