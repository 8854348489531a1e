"""`hax_jax.loss.weighted_nll` (the head's gradient taken in the forward, a chunk of positions at a
time) against its obvious twin: autodiff of the weighted sum of optax's cross-entropy over the
whole rows' logits."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hax_jax.config import MeshConfig
from hax_jax.loss import weighted_nll
from hax_jax.sharding import make_mesh

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


@pytest.mark.parametrize("head", [_tied, _untied])
@pytest.mark.parametrize("n_chunks", [1, 2, 4, 3])  # 3: 6 positions a chunk, 2 of them padding
def test_weighted_nll_on_a_mesh_equals_whole_rows(head, n_chunks):
    """On data x seq x tensor = 2 x 2 x 2 (rows, positions and the vocabulary split), where each
    device sums its own part of the head's gradient over the chunks and the devices' parts are
    summed once after them: the twin's loss and gradients."""
    b, l, v = 4, 16, 14
    keys = jax.random.split(jax.random.key(1), 4)
    h = jax.random.normal(keys[0], (b, l, D))
    labels = jax.random.randint(keys[1], (b, l), 0, v)
    weights = jax.random.uniform(keys[2], (b, l))
    kernel = jax.random.normal(keys[3], (v, D)) * 0.5
    params = {"embedding": kernel} if head is _tied else {"kernel": kernel.T, "bias": kernel[:, 0]}
    want, want_grads = jax.value_and_grad(_twin, argnums=(0, 4))(h, labels, weights, head, params)
    mesh = make_mesh(MeshConfig(data=2, seq=2, tensor=2))

    def fused(h, params):
        return weighted_nll(h, labels, weights, head, params, n_chunks)[0]

    with jax.set_mesh(mesh):
        h = jax.device_put(h, jax.sharding.PartitionSpec("data", "seq"))
        got, got_grads = jax.jit(jax.value_and_grad(fused, argnums=(0, 1)))(h, params)
    _close(got, want)
    _close(got_grads, want_grads)


def test_the_heads_gradient_is_summed_over_the_devices_after_the_chunks():
    """On data x seq = 2 x 2 with 4 chunks, the compiled gradient sums the head's parameters
    over the devices outside the chunks' loop (once a step, not once a chunk)."""
    b, l, v = 4, 16, 14
    h = jnp.ones((b, l, D))
    labels, weights = jnp.zeros((b, l), jnp.int32), jnp.ones((b, l))
    params = {"embedding": jnp.ones((v, D))}
    mesh = make_mesh(MeshConfig(data=2, seq=2, tensor=2))

    def loss(h, params):
        return weighted_nll(h, labels, weights, _tied, params, 4)[0]

    with jax.set_mesh(mesh):
        h = jax.device_put(h, jax.sharding.PartitionSpec("data", "seq"))
        hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(h, params).compile().as_text()
    bodies = set(re.findall(r"\bwhile\(.*?body=%?([\w.\-]+)", hlo))
    computations = re.split(r"\n(?=\S)", hlo)  # each starts with its name (or ENTRY)
    summed = {
        computation.split(maxsplit=1)[0].lstrip("%")
        for computation in computations
        if re.search(
            rf"f32\[{v // 2},{D}\]\S* all-reduce(-start)?\(", computation
        )  # vocab / tensor
    }
    assert bodies and summed and not summed & bodies
