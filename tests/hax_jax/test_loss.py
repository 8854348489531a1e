"""`hax_jax.loss.weighted_nll` (the head's gradient taken in the forward, a chunk of positions at a
time) against its obvious twin: autodiff of the weighted sum of optax's cross-entropy over the
whole rows' logits."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hax_jax.loss import weighted_nll

# fp32: |a - b| <= ATOL + RTOL |b| per element (the chunks only reorder sums over positions).
RTOL, ATOL = 1e-5, 1e-6
B, L, D, V = 2, 10, 8, 13


def _tied(params, h):
    """A tied head: logits = h E^T."""
    return (h @ params["embedding"].T).astype(jnp.float32)


def _untied(params, h):
    """A separate head with a bias."""
    return (h @ params["kernel"] + params["bias"]).astype(jnp.float32)


def _inputs(head, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(0), 6)
    h = jax.random.normal(keys[0], (B, L, D), dtype)
    labels = jax.random.randint(keys[1], (B, L), 0, V)
    mask = jax.random.bernoulli(keys[2], 0.7, (B, L)).astype(jnp.float32)
    weights = mask / mask.sum()
    if head is _tied:
        params = {"embedding": jax.random.normal(keys[3], (V, D)) * 0.5}
    else:
        params = {
            "kernel": jax.random.normal(keys[4], (D, V)) * 0.5,
            "bias": jax.random.normal(keys[5], (V,)) * 0.1,
        }
    return h, labels, weights, params


def _twin(h, labels, weights, head, params):
    """The weighted sum over positions of optax's cross-entropy of the whole rows' logits."""
    nll = optax.softmax_cross_entropy_with_integer_labels(head(params, h), labels)
    return jnp.sum(weights * nll)


def _close(got, want):
    jax.tree.map(
        lambda g, w: np.testing.assert_allclose(np.asarray(g), np.asarray(w), RTOL, ATOL), got, want
    )


@pytest.mark.parametrize("head", [_tied, _untied])
@pytest.mark.parametrize("n_chunks", [1, 2, 3, L])  # 3: 4 positions a chunk, 2 of them padding
def test_weighted_nll_equals_autodiff_of_whole_rows(head, n_chunks):
    h, labels, weights, params = _inputs(head)
    want, want_grads = jax.value_and_grad(_twin, argnums=(0, 4))(h, labels, weights, head, params)

    def fused(h, params):
        total, _ = weighted_nll(h, labels, weights, head, params, n_chunks)
        return total

    got, got_grads = jax.jit(jax.value_and_grad(fused, argnums=(0, 1)))(h, params)
    _close(got, want)
    _close(got_grads, want_grads)
    _, predictions = weighted_nll(h, labels, weights, head, params, n_chunks)
    np.testing.assert_array_equal(predictions, jnp.argmax(head(params, h), -1))


def test_the_cotangent_scales_the_gradients():
    """A loss that is not the sum itself (here 2.5 x it, plus another term in h) gets 2.5 x the
    head's gradients, and h's other gradient adds to it."""
    h, labels, weights, params = _inputs(_untied)

    def loss(nll_sum, h, params):
        return 2.5 * nll_sum(h, params) + jnp.sum(h**2)

    want = jax.grad(
        lambda h, p: loss(lambda h, p: _twin(h, labels, weights, _untied, p), h, p), (0, 1)
    )
    got = jax.grad(
        lambda h, p: loss(lambda h, p: weighted_nll(h, labels, weights, _untied, p, 2)[0], h, p),
        (0, 1),
    )
    _close(got(h, params), want(h, params))


def test_gradients_keep_the_dtypes():
    """bf16 hidden states get a bf16 gradient, fp32 parameters fp32 ones."""
    h, labels, weights, params = _inputs(_tied, jnp.bfloat16)
    params = {"embedding": params["embedding"].astype(jnp.float32)}
    d_h, d_params = jax.grad(lambda h, p: weighted_nll(h, labels, weights, _tied, p, 2)[0], (0, 1))(
        h, params
    )
    assert d_h.dtype == jnp.bfloat16
    assert d_params["embedding"].dtype == jnp.float32
