"""The depthwise causal conv (hax_jax/layers/conv.py), its output and the gradients of x, kernel,
bias and state, against the definition: y_t = bias + sum_j kernel[j] w_{t+j} over w = [state | x],
a tap kept only where it reads the output's own document."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hax_jax.layers.conv import causal_conv1d

# Per dtype of x / state, once: fp32 sums reordered; bf16 outputs rounded to bf16 once.
TOL = {jnp.float32: dict(atol=1e-5, rtol=1e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def conv_by_definition(x, kernel, bias, state, seq_idx, state_seq_idx):
    """The window of every output gathered explicitly, (b, l, k, c), in fp32."""
    b, l, c = x.shape
    k = kernel.shape[0]
    w = jnp.concatenate([state, x], axis=1).astype(jnp.float32)
    index = jnp.arange(l)[:, None] + jnp.arange(k)[None, :]  # (l, k): w positions of the taps
    windows = w[:, index]  # (b, l, k, c)
    if seq_idx is not None:
        docs = jnp.concatenate([state_seq_idx, seq_idx], axis=1)[:, index]  # (b, l, k)
        windows = windows * (docs == seq_idx[:, :, None])[..., None]
    y = jnp.einsum("blkc,kc->blc", windows, kernel.astype(jnp.float32))
    if bias is not None:
        y = y + bias
    return y.astype(x.dtype)


def inputs(l, k, dtype, *, documents, bias=True, seed=0):
    b, c = 2, 5
    keys = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(keys[0], (b, l, c)).astype(dtype)
    kernel = jax.random.normal(keys[1], (k, c))
    bias = jax.random.normal(keys[2], (c,)) if bias else None
    state = jax.random.normal(keys[3], (b, k - 1, c)).astype(dtype)
    seq_idx = state_seq_idx = None
    if documents:
        # Row 0: boundaries inside the state's reach and later; row 1: one document throughout.
        starts = np.zeros((b, l), np.int32)
        starts[0, [1, min(l - 1, 5)]] = 1
        seq_idx = jnp.asarray(np.cumsum(starts, axis=1), jnp.int32)
        state_seq_idx = jnp.stack([jnp.array([-1, 0, 0][-(k - 1) :]), jnp.zeros(k - 1, int)])
        state_seq_idx = state_seq_idx.astype(jnp.int32)
    return x, kernel, bias, state, seq_idx, state_seq_idx


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("l", [2, 3, 11])  # shorter than, as long as, longer than the window
def test_forward_and_gradients_equal_the_definition(dtype, documents, l):
    x, kernel, bias, state, seq_idx, state_seq_idx = inputs(l, 4, dtype, documents=documents)
    cotangent = jax.random.normal(jax.random.key(9), x.shape).astype(dtype)

    def vjp(conv):
        y, pull = jax.vjp(lambda *a: conv(*a, seq_idx, state_seq_idx), x, kernel, bias, state)
        return y, pull(cotangent)

    ours = vjp(lambda *a: causal_conv1d(*a)[0])
    oracle = vjp(conv_by_definition)
    tol = TOL[dtype]
    np.testing.assert_allclose(ours[0].astype(np.float32), oracle[0].astype(np.float32), **tol)
    for name, got, want in zip(("x", "kernel", "bias", "state"), ours[1], oracle[1], strict=True):
        assert got.dtype == want.dtype, name
        np.testing.assert_allclose(
            got.astype(np.float32), want.astype(np.float32), err_msg=name, **tol
        )


def test_without_bias_and_width_two():
    x, kernel, _, state, seq_idx, state_seq_idx = inputs(7, 2, jnp.float32, documents=False)
    grads = jax.grad(lambda *a: jnp.sum(causal_conv1d(*a, None, state)[0] ** 2), (0, 1))(x, kernel)
    want = jax.grad(
        lambda *a: jnp.sum(conv_by_definition(*a, None, state, None, None) ** 2), (0, 1)
    )(x, kernel)
    for got, expected in zip(grads, want, strict=True):
        np.testing.assert_allclose(got, expected, **TOL[jnp.float32])


def test_new_state_is_the_last_inputs_of_the_last_document():
    x, kernel, bias, state, seq_idx, state_seq_idx = inputs(11, 4, jnp.float32, documents=True)
    _, new_state = causal_conv1d(x, kernel, bias, state, seq_idx, state_seq_idx)
    np.testing.assert_array_equal(new_state[1], x[1, -3:])  # one document
    np.testing.assert_array_equal(new_state[0], x[0, -3:])  # the last document began at 5
