"""Tests for the Mamba-1 selective scan: the associative fast path against the definition."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_checks import largest_array, selective_scan_inputs

from pallas_kernels.selective_scan import selective_scan, selective_scan_reference

jax.config.update("jax_enable_x64", False)

# Forward and gradient tolerances, per input dtype. bf16: outputs are rounded to bf16 once.
TOL = {jnp.float32: dict(atol=1e-5, rtol=1e-5), jnp.bfloat16: dict(atol=1e-2, rtol=1e-2)}
GRAD_TOL = dict(atol=1e-4, rtol=1e-4)
FD_TOL = dict(atol=1e-7, rtol=1e-6)  # float64 central differences, eps = 1e-6


def call(inputs, **kwargs):
    """Call selective_scan with a dict of inputs (None entries dropped)."""
    pos = [inputs[name] for name in ("x", "dt", "A", "B", "C")]
    opt = {k: v for k, v in inputs.items() if k in ("D", "z", "initial_state") and v is not None}
    return selective_scan(*pos, **opt, **kwargs)


def assert_close(actual, desired, tol):
    """assert_allclose on fp32 copies."""
    actual, desired = np.asarray(actual, np.float32), np.asarray(desired, np.float32)
    np.testing.assert_allclose(actual, desired, **tol)


@pytest.mark.parametrize(
    "shape, chunk_size, optional",
    [
        ((2, 37, 5, 4), 8, ("D", "z", "initial_state")),  # l not a multiple of the chunk
        ((2, 37, 5, 4), 8, ()),
        ((2, 37, 5, 4), 64, ("initial_state",)),  # one chunk shorter than chunk_size
        ((1, 32, 3, 2), 16, ("D", "z")),  # exact multiple
    ],
)
def test_associative_matches_reference(shape, chunk_size, optional):
    """y and final state of the associative path equal the sequential definition."""
    inputs = selective_scan_inputs(*shape)
    for name in ("D", "z", "initial_state"):
        if name not in optional:
            inputs[name] = None
    y_ref, h_ref = call(inputs, impl="reference", return_final_state=True)
    y, h = call(inputs, impl="associative", chunk_size=chunk_size, return_final_state=True)
    assert y.shape == shape[:3] and h.shape == (shape[0], shape[2], shape[3])
    assert y.dtype == jnp.float32 and h.dtype == jnp.float32
    assert_close(y, y_ref, TOL[jnp.float32])
    assert_close(h, h_ref, TOL[jnp.float32])
    assert_close(call(inputs, chunk_size=chunk_size), y_ref, TOL[jnp.float32])


def _loss_grads(impl, inputs, seed=1):
    """Gradients of a random linear functional of (y, final_state) wrt every input."""
    b, l, d = inputs["x"].shape
    n = inputs["A"].shape[1]
    rng = np.random.default_rng(seed)
    wy, wh = rng.standard_normal((b, l, d)), rng.standard_normal((b, d, n))

    def loss(inp):
        """Scalar loss touching both outputs."""
        y, h = call(inp, impl=impl, chunk_size=8, return_final_state=True)
        return jnp.sum(y * wy) + jnp.sum(h * wh)

    return jax.jit(jax.grad(loss))(inputs)


def test_gradients_match_reference():
    """Autodiff through the associative path equals autodiff through the definition."""
    inputs = selective_scan_inputs(2, 19, 3, 4, seed=2)
    g_ref = _loss_grads("reference", inputs)
    g = _loss_grads("associative", inputs)
    for name in inputs:
        assert np.all(np.isfinite(g[name])), name
        assert_close(g[name], g_ref[name], GRAD_TOL)


def test_reference_gradient_matches_finite_differences():
    """Reference gradients equal float64 central differences along random directions."""
    with jax.enable_x64(True):
        inputs = {
            k: v.astype(jnp.float64) for k, v in selective_scan_inputs(1, 5, 2, 3, seed=3).items()
        }
        rng = np.random.default_rng(4)
        w = rng.standard_normal((1, 5, 2))

        @jax.jit
        def loss(inp):
            """Scalar loss of the reference output."""
            y, h = call(inp, impl="reference", return_final_state=True)
            return jnp.sum(y * w) + jnp.sum(h**2)

        grads = jax.grad(loss)(inputs)
        eps = 1e-6
        for name in inputs:
            v = rng.standard_normal(inputs[name].shape)
            plus = dict(inputs, **{name: inputs[name] + eps * v})
            minus = dict(inputs, **{name: inputs[name] - eps * v})
            fd = (loss(plus) - loss(minus)) / (2 * eps)
            np.testing.assert_allclose(jnp.vdot(grads[name], v), fd, err_msg=name, **FD_TOL)


def test_split_and_carry_equals_whole():
    """Scanning two halves, carrying final_state -> initial_state, equals one scan."""
    inputs = selective_scan_inputs(2, 37, 5, 4, seed=5)
    y, h = call(inputs, chunk_size=8, return_final_state=True)
    seq = ("x", "dt", "B", "C", "z")
    first = {k: (v[:, :20] if k in seq else v) for k, v in inputs.items()}
    second = {k: (v[:, 20:] if k in seq else v) for k, v in inputs.items()}
    y1, h1 = call(first, chunk_size=8, return_final_state=True)
    second["initial_state"] = h1
    y2, h2 = call(second, chunk_size=8, return_final_state=True)
    assert_close(jnp.concatenate([y1, y2], axis=1), y, TOL[jnp.float32])
    assert_close(h2, h, TOL[jnp.float32])


def test_padding_does_not_leak_into_final_state():
    """Chunk padding (dt = 0) leaves the final state exactly as one unpadded chunk gives."""
    inputs = selective_scan_inputs(1, 13, 3, 2, seed=6)
    _, h_pad = call(inputs, chunk_size=8, return_final_state=True)  # pads 13 -> 16
    _, h_one = call(inputs, chunk_size=13, return_final_state=True)  # no padding
    assert_close(h_pad, h_one, TOL[jnp.float32])


def test_bf16_inputs_match_fp32_reference():
    """bf16 inputs compute in fp32: y (bf16) and final state (fp32) match the fp32 reference."""
    inputs = selective_scan_inputs(2, 37, 5, 4, seed=7, dtype=jnp.bfloat16)
    y, h = call(inputs, chunk_size=8, return_final_state=True)
    assert y.dtype == jnp.bfloat16 and h.dtype == jnp.float32
    up = {k: v.astype(jnp.float32) for k, v in inputs.items()}
    y_ref, h_ref = selective_scan_reference(**up, return_final_state=True)
    assert_close(y, y_ref, TOL[jnp.bfloat16])
    assert_close(h, h_ref, TOL[jnp.float32])


def test_backward_never_materializes_full_state_sequence():
    """Forward + backward keep at most (b, chunk, d, n) states, never (b, l, d, n)."""
    b, l, d, n = 1, 512, 4, 4
    inputs = selective_scan_inputs(b, l, d, n, seed=8)

    def loss(inp):
        """Sum of outputs and final state."""
        y, h = call(inp, chunk_size=16, return_final_state=True)
        return jnp.sum(y) + jnp.sum(h)

    biggest = largest_array(jax.make_jaxpr(jax.grad(loss))(inputs).jaxpr)
    assert biggest < b * l * d * n, biggest


@pytest.mark.parametrize(
    "name, bad, match",
    [
        ("x", jnp.zeros((2, 7)), "x must have shape"),
        ("dt", jnp.zeros((2, 7, 4)), "dt must have shape"),
        ("A", jnp.zeros((4, 2)), "A must have shape"),
        ("B", jnp.zeros((2, 7, 3)), "B must have shape"),
        ("C", jnp.zeros((2, 6, 2)), "C must have shape"),
        ("D", jnp.zeros((4,)), "D must have shape"),
        ("z", jnp.zeros((2, 7, 2)), "z must have shape"),
        ("initial_state", jnp.zeros((2, 3, 3)), "initial_state must have shape"),
        ("x", jnp.zeros((2, 7, 3), jnp.int32), "x must have a floating dtype"),
    ],
)
def test_bad_inputs_raise(name, bad, match):
    """Shape or dtype errors raise ValueError naming the offending input."""
    inputs = selective_scan_inputs(2, 7, 3, 2)
    inputs[name] = bad
    with pytest.raises(ValueError, match=match):
        call(inputs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(chunk_size=0), "chunk_size must be a positive int"),
        (dict(chunk_size=8.0), "chunk_size must be a positive int"),
        (dict(impl="fused"), "impl must be one of"),
    ],
)
def test_bad_static_args_raise(kwargs, match):
    """Bad chunk_size or impl raise ValueError naming it."""
    with pytest.raises(ValueError, match=match):
        call(selective_scan_inputs(2, 7, 3, 2), **kwargs)
