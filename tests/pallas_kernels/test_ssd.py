"""Tests for Mamba-2 SSD: chunked == quadratic reference == sequential recurrence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ssd import ssd

jax.config.update("jax_enable_x64", False)

# Forward and gradient tolerances, per input dtype. bf16: outputs are rounded to bf16 once.
TOL = {jnp.float32: dict(atol=1e-5, rtol=1e-5), jnp.bfloat16: dict(atol=1e-2, rtol=1e-2)}
GRAD_TOL = dict(atol=1e-4, rtol=1e-4)

B_, L_, H_, P_, N_ = 2, 37, 4, 3, 5  # l = 37 is not a multiple of any chunk size below
# Row 0: boundaries at 10 (inside every chunk size) and 16 (on a chunk edge for 4, 8, 16).
# Row 1: boundary at 8, a one-position document, ids that skip values.
SEQ_IDX = np.array([[0] * 10 + [1] * 6 + [2] * 21, [3] * 8 + [4] + [7] * 28], np.int32)


def make_inputs(g, seed=0, l=L_, dtype=jnp.float32):
    """Random SSD inputs (numpy RNG: no per-op compiles): positive dt, negative A."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape, np.float32)  # noqa: E731
    inputs = dict(
        x=normal(B_, l, H_, P_),
        dt=np.log1p(np.exp(normal(B_, l, H_) - 1.0)),  # softplus
        A=-np.exp(normal(H_)),
        B=normal(B_, l, g, N_),
        C=normal(B_, l, g, N_),
        D=normal(H_),
        initial_state=normal(B_, H_, P_, N_),
    )
    return {k: jnp.asarray(v, dtype) for k, v in inputs.items()}


def call(inputs, seq_idx=None, chunk_size=8, **kwargs):
    """Call ssd with a dict of inputs, always returning (y, final_state)."""
    pos = [inputs[name] for name in ("x", "dt", "A", "B", "C")]
    opt = {k: v for k, v in inputs.items() if k in ("D", "initial_state") and v is not None}
    if seq_idx is not None:
        opt["seq_idx"] = jnp.asarray(seq_idx)
    return ssd(*pos, **opt, chunk_size=chunk_size, return_final_state=True, **kwargs)


def assert_close(actual, desired, tol):
    """assert_allclose on fp32 copies."""
    actual, desired = np.asarray(actual, np.float32), np.asarray(desired, np.float32)
    np.testing.assert_allclose(actual, desired, **tol)


@pytest.mark.parametrize("g", [1, 2])
@pytest.mark.parametrize("chunk_size", [4, 8, 16])
def test_chunked_matches_references(chunk_size, g):
    """chunked, quadratic reference and sequential recurrence agree on y and final state."""
    inputs = make_inputs(g)
    y_seq, h_seq = call(inputs, impl="sequential")
    y_ref, h_ref = call(inputs, impl="reference")
    y, h = call(inputs, chunk_size=chunk_size)
    assert y.shape == (B_, L_, H_, P_) and h.shape == (B_, H_, P_, N_)
    assert y.dtype == jnp.float32 and h.dtype == jnp.float32
    for actual in (y_ref, y):
        assert_close(actual, y_seq, TOL[jnp.float32])
    for actual in (h_ref, h):
        assert_close(actual, h_seq, TOL[jnp.float32])


def test_without_optional_inputs():
    """Without D and initial_state (and y-only output) the impls still agree."""
    inputs = make_inputs(2)
    pos = [inputs[name] for name in ("x", "dt", "A", "B", "C")]
    y_seq = ssd(*pos, chunk_size=8, impl="sequential")
    assert_close(ssd(*pos, chunk_size=8, impl="reference"), y_seq, TOL[jnp.float32])
    assert_close(ssd(*pos, chunk_size=8), y_seq, TOL[jnp.float32])


def _runs(row):
    """(start, stop) of each maximal run of equal values in a 1-d array."""
    edges = [0] + [t for t in range(1, len(row)) if row[t] != row[t - 1]] + [len(row)]
    return list(zip(edges[:-1], edges[1:]))


@pytest.mark.parametrize("chunk_size", [4, 8])
def test_seq_idx_equals_separate_documents(chunk_size):
    """With seq_idx every impl equals running each document on its own."""
    inputs = make_inputs(2, seed=1)
    y, h = call(inputs, SEQ_IDX, chunk_size=chunk_size)
    y_ref, h_ref = call(inputs, SEQ_IDX, impl="reference")
    y_seq, h_seq = call(inputs, SEQ_IDX, impl="sequential")
    for actual, desired in ((y_ref, y), (y_seq, y), (h_ref, h), (h_seq, h)):
        assert_close(actual, desired, TOL[jnp.float32])
    for row in range(B_):
        runs = _runs(SEQ_IDX[row])
        for i, (start, stop) in enumerate(runs):
            doc = {k: v[row : row + 1] for k, v in inputs.items() if k not in ("A", "D")}
            doc = {k: (v if k == "initial_state" else v[:, start:stop]) for k, v in doc.items()}
            doc.update(A=inputs["A"], D=inputs["D"])
            if i > 0:
                doc["initial_state"] = None  # only the row's first document gets it
            y_doc, h_doc = call(doc, impl="sequential")
            assert_close(y[row : row + 1, start:stop], y_doc, TOL[jnp.float32])
            if i == len(runs) - 1:
                assert_close(h[row : row + 1], h_doc, TOL[jnp.float32])


def _loss_grads(impl, inputs, seq_idx):
    """Gradients of a random linear functional of (y, final_state) wrt every float input."""
    rng = np.random.default_rng(2)
    wy = rng.standard_normal(inputs["x"].shape)
    wh = rng.standard_normal(inputs["initial_state"].shape)

    def loss(inp):
        """Scalar loss touching both outputs."""
        y, h = call(inp, seq_idx, impl=impl)
        return jnp.sum(y * wy) + jnp.sum(h * wh)

    return jax.jit(jax.grad(loss))(inputs)


@pytest.mark.parametrize("seq_idx", [None, SEQ_IDX], ids=["no_seq_idx", "seq_idx"])
def test_gradients_match_sequential(seq_idx):
    """Autodiff through chunked (and reference) equals autodiff through the recurrence."""
    inputs = make_inputs(2, seed=3)
    # Some very fast decays: exp underflows to 0 and must not turn into NaN gradients.
    inputs["dt"] = inputs["dt"].at[:, 20:23].mul(200.0)
    g_seq = _loss_grads("sequential", inputs, seq_idx)
    for impl in ("chunked", "reference"):
        g = _loss_grads(impl, inputs, seq_idx)
        for name in inputs:
            assert np.all(np.isfinite(g[name])), (impl, name)
            assert_close(g[name], g_seq[name], GRAD_TOL)


@pytest.mark.parametrize("seq_idx", [None, SEQ_IDX], ids=["no_seq_idx", "seq_idx"])
def test_split_and_carry_equals_whole(seq_idx):
    """Two calls carrying final_state -> initial_state equal one call (split inside a doc)."""
    inputs = make_inputs(1, seed=4)
    y, h = call(inputs, seq_idx)
    cut = 13  # inside a chunk and inside document 1 / the last document of each row
    parts = []
    for sl in (slice(None, cut), slice(cut, None)):
        part = {k: (v[:, sl] if k in ("x", "dt", "B", "C") else v) for k, v in inputs.items()}
        if parts:
            part["initial_state"] = parts[-1][1]
        parts.append(call(part, None if seq_idx is None else seq_idx[:, sl]))
    assert_close(jnp.concatenate([parts[0][0], parts[1][0]], axis=1), y, TOL[jnp.float32])
    assert_close(parts[1][1], h, TOL[jnp.float32])


def test_bf16_inputs_match_fp32_reference():
    """bf16 inputs compute in fp32: y (bf16) and final state (fp32) match the fp32 path."""
    inputs = make_inputs(2, seed=5, dtype=jnp.bfloat16)
    y, h = call(inputs, SEQ_IDX)
    assert y.dtype == jnp.bfloat16 and h.dtype == jnp.float32
    up = {k: v.astype(jnp.float32) for k, v in inputs.items()}
    y_ref, h_ref = call(up, SEQ_IDX, impl="sequential")
    assert_close(y, y_ref, TOL[jnp.bfloat16])
    assert_close(h, h_ref, TOL[jnp.float32])


@pytest.mark.parametrize(
    "name, bad, match",
    [
        ("x", jnp.zeros((2, 7, 4)), "x must have shape"),
        ("dt", jnp.zeros((2, 7, 3)), "dt must have shape"),
        ("A", jnp.zeros((4, 1)), "A must have shape"),
        ("B", jnp.zeros((2, 6, 2, 5)), "B must have shape"),
        ("C", jnp.zeros((2, 7, 2, 4)), "C must have shape"),
        ("B", jnp.zeros((2, 7, 3, 5)), "h = 4 must be a multiple of groups g = 3"),
        ("D", jnp.zeros((3,)), "D must have shape"),
        ("initial_state", jnp.zeros((2, 4, 3, 4)), "initial_state must have shape"),
        ("seq_idx", jnp.zeros((2, 6), jnp.int32), "seq_idx must have shape"),
        ("seq_idx", jnp.zeros((2, 7)), "seq_idx must have an integer dtype"),
        ("dt", jnp.zeros((2, 7, 4), jnp.int32), "dt must have a floating dtype"),
    ],
)
def test_bad_inputs_raise(name, bad, match):
    """Shape, dtype and grouping errors raise ValueError naming the offending value."""
    inputs = make_inputs(2, l=7)
    inputs["seq_idx"] = jnp.zeros((2, 7), jnp.int32)
    if name == "B":  # keep C consistent so the error is about B
        inputs["C"] = bad
    inputs[name] = bad
    with pytest.raises(ValueError, match=match):
        pos = [inputs[k] for k in ("x", "dt", "A", "B", "C")]
        ssd(
            *pos,
            chunk_size=4,
            D=inputs["D"],
            initial_state=inputs["initial_state"],
            seq_idx=inputs["seq_idx"],
        )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(chunk_size=0), "chunk_size must be a positive int, got 0"),
        (dict(chunk_size=-4), "chunk_size must be a positive int, got -4"),
        (dict(chunk_size=4.0), "chunk_size must be a positive int, got 4.0"),
        (dict(chunk_size=True), "chunk_size must be a positive int, got True"),
        (dict(impl="triton"), "impl must be one of"),
    ],
)
def test_bad_static_args_raise(kwargs, match):
    """Bad chunk_size or impl raise ValueError naming it."""
    inputs = make_inputs(2, l=7)
    pos = [inputs[k] for k in ("x", "dt", "A", "B", "C")]
    kwargs = dict(dict(chunk_size=4), **kwargs)
    with pytest.raises(ValueError, match=match):
        ssd(*pos, **kwargs)
