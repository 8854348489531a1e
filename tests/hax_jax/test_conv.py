"""The depthwise causal conv (hax_jax/layers/conv.py), its output and the gradients of x, kernel,
bias and state, against the definition: y_t = bias + sum_j kernel[j] w_{t+j} over w = [state | x],
a tap kept only where it reads the output's own document; with silu, SiLU(y_t) = y_t / (1 + e^-y_t)
in fp32."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hax_jax.layers.conv import causal_conv1d
from pallas_kernels.conv1d import supports as conv_kernels_take

# Per dtype of x / state, once: fp32 sums reordered; bf16 outputs rounded to bf16 once.
TOL = {jnp.float32: dict(atol=1e-5, rtol=1e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def conv_by_definition(x, kernel, bias, state, seq_idx, state_seq_idx, silu=False):
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
    if silu:
        y = y / (1.0 + jnp.exp(-y))
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


@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("l", [2, 3, 11])  # shorter than, as long as, longer than the window
def test_forward_and_gradients_equal_the_definition(dtype, documents, l, silu):
    x, kernel, bias, state, seq_idx, state_seq_idx = inputs(l, 4, dtype, documents=documents)
    cotangent = jax.random.normal(jax.random.key(9), x.shape).astype(dtype)

    def vjp(conv):
        y, pull = jax.vjp(lambda *a: conv(*a, seq_idx, state_seq_idx), x, kernel, bias, state)
        return y, pull(cotangent)

    ours = vjp(lambda *a: causal_conv1d(*a, silu=silu)[0])
    oracle = vjp(lambda *a: conv_by_definition(*a, silu=silu))
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


# ------------------------------------------------------------- the Triton kernels (pallas_kernels)


@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("l, c", [(32, 24), (128, 20)])  # one chunk; four, over programs
def test_kernels_equal_the_definition(monkeypatch, dtype, documents, l, c, silu):
    """The layer's conv with the kernels taken (interpreted here): output, new state and every
    gradient, documents starting inside the state's reach, at chunk edges and at the last row."""
    import hax_jax.layers.conv as conv
    import pallas_kernels.conv1d.kernel as conv_kernel

    monkeypatch.setattr(conv, "auto_picks_pallas", lambda: True)
    monkeypatch.setattr(conv_kernel, "PROGRAMS", 4)  # several chunks a program where l allows
    k, b = 4, 2
    keys = jax.random.split(jax.random.key(3), 5)
    x = jax.random.normal(keys[0], (b, l, c)).astype(dtype)
    kernel = jax.random.normal(keys[1], (k, c))
    bias = jax.random.normal(keys[2], (c,))
    state = jax.random.normal(keys[3], (b, k - 1, c)).astype(dtype)
    seq_idx = state_seq_idx = None
    if documents:
        starts = np.zeros((b, l), np.int32)
        starts[0, [p for p in (1, 5, 31, 33, 64, 95, l - 1) if p < l]] = 1
        starts[1, l // 2] = 1
        seq_idx = jnp.asarray(np.cumsum(starts, axis=1), jnp.int32)
        state_seq_idx = jnp.array([[-1, 0, 0], [0, 0, 0]], jnp.int32)
    cotangent = jax.random.normal(keys[4], x.shape).astype(dtype)

    def vjp(f):
        out, pull = jax.vjp(lambda *a: f(*a, seq_idx, state_seq_idx), x, kernel, bias, state)
        return out, pull((cotangent, jnp.zeros_like(out[1])))

    def definition(*args):
        y = conv_by_definition(*args, silu=silu)
        return y, conv.causal_conv1d(*args)[1]  # the new state: checked apart below

    ours, oracle = vjp(functools.partial(conv.causal_conv1d, silu=silu)), vjp(definition)
    assert conv_kernels_take(l, k)
    jaxpr = str(jax.make_jaxpr(lambda *a: conv.causal_conv1d(*a))(x, kernel, bias, state))
    assert "causal_conv1d_fwd" in jaxpr
    got, want = jax.tree.leaves(ours), jax.tree.leaves(oracle)
    for name, a, e in zip(("y", "state", "x", "kernel", "bias", "dstate"), got, want, strict=True):
        assert a.dtype == e.dtype, name
        np.testing.assert_allclose(
            a.astype(np.float32), e.astype(np.float32), err_msg=name, **TOL[dtype]
        )
    tail = np.array(x[:, -3:])
    if documents:  # row 0's last document is its last row alone
        tail[0, :2] = 0
    np.testing.assert_array_equal(np.asarray(ours[0][1]), tail)


@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("kernels", [False, True])
def test_channels_of_a_wider_input_written_in_parts(monkeypatch, kernels, documents, silu):
    """The conv of x's channels 8 .. 32 of 36 (a projection's output read in place), y written
    as parts of 16 and 8: each part, the new state and every gradient (x's zero outside those
    channels) as the definition's on the slice."""
    import hax_jax.layers.conv as conv
    import pallas_kernels.conv1d.kernel as conv_kernel

    monkeypatch.setattr(conv, "auto_picks_pallas", lambda: kernels)
    monkeypatch.setattr(conv_kernel, "PROGRAMS", 4)
    b, l, k, start, parts = 2, 64, 4, 8, (16, 8)
    keys = jax.random.split(jax.random.key(4), 6)
    x = jax.random.normal(keys[0], (b, l, 36))
    kernel, bias = jax.random.normal(keys[1], (k, 24)), jax.random.normal(keys[2], (24,))
    state = jax.random.normal(keys[3], (b, k - 1, 24))
    seq_idx = state_seq_idx = None
    if documents:
        starts = np.zeros((b, l), np.int32)
        starts[0, [2, 31, 32, 50]] = 1
        seq_idx = jnp.asarray(np.cumsum(starts, axis=1), jnp.int32)
        state_seq_idx = jnp.zeros((b, k - 1), jnp.int32)
    cotangents = [jax.random.normal(keys[4 + i], (b, l, w)) for i, w in enumerate(parts)]

    def ours(x, kernel, bias, state):
        out = conv.causal_conv1d(
            x, kernel, bias, state, seq_idx, state_seq_idx, silu=silu, start=start, parts=parts
        )
        return tuple(out[0]), out[1]

    def definition(x, kernel, bias, state):
        window = x[..., start : start + 24]
        y = conv_by_definition(window, kernel, bias, state, seq_idx, state_seq_idx, silu=silu)
        new_state = conv.causal_conv1d(window, kernel, bias, state, seq_idx, state_seq_idx)[1]
        return (y[..., :16], y[..., 16:]), new_state

    def vjp(f):
        out, pull = jax.vjp(f, x, kernel, bias, state)
        return out, pull((tuple(cotangents), jnp.zeros_like(out[1])))

    got, want = jax.tree.leaves(vjp(ours)), jax.tree.leaves(vjp(definition))
    names = ("y0", "y1", "state", "x", "kernel", "bias", "dstate")
    for name, a, e in zip(names, got, want, strict=True):
        assert a.shape == e.shape, name
        np.testing.assert_allclose(a, e, err_msg=name, **TOL[jnp.float32])
    if kernels:
        jaxpr = str(jax.make_jaxpr(ours)(x, kernel, bias, state))
        assert "causal_conv1d_fwd" in jaxpr


@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("in_place", [False, True])
def test_kernels_lower_for_cuda(silu, in_place):
    """Lowered for CUDA: the plain conv, and one reading channels 128 .. 384 of a 512-wide x and
    writing them as two parts."""
    from pallas_kernels.backend import lower_for
    from pallas_kernels.conv1d import causal_conv1d_pallas

    x = jnp.ones((2, 256, 512 if in_place else 256), jnp.bfloat16)
    args = (x, jnp.ones((4, 256)), jnp.ones((256,)), jnp.zeros((2, 3, 256), jnp.bfloat16))
    seq = jnp.zeros((2, 256), jnp.int32), jnp.zeros((2, 3), jnp.int32)
    where = dict(start=128, parts=(128, 128)) if in_place else {}

    def loss(*a):
        y = causal_conv1d_pallas(*a, *seq, silu=silu, interpret=False, **where)
        return sum(jnp.sum(part.astype(jnp.float32)) for part in jax.tree.leaves(y))

    text = lower_for("cuda", jax.grad(loss, argnums=(0, 1, 2, 3)), *args)
    assert "causal_conv1d_fwd" in text and "causal_conv1d_bwd" in text
    assert ("causal_conv1d_silu_bwd" in text) == silu


@pytest.mark.gpu
@pytest.mark.parametrize(
    "documents, silu, in_place", [(False, False, False), (False, True, True), (True, True, True)]
)
def test_kernels_compiled_on_gpu(documents, silu, in_place):
    """Compiled, at Mamba-2 1.3B's conv width; in place: as the model calls them, reading the
    channels after z (4096) of in_proj's output and writing x, B, C apart."""
    from pallas_kernels.conv1d import causal_conv1d_pallas

    b, l, c, k = 2, 2048, 4352, 4
    start, width, parts = (4096, 8480, (4096, 128, 128)) if in_place else (0, c, None)
    keys = jax.random.split(jax.random.key(5), 5)
    x = jax.random.normal(keys[0], (b, l, width)).astype(jnp.bfloat16)
    kernel, bias = jax.random.normal(keys[1], (k, c)), jax.random.normal(keys[2], (c,))
    state = jax.random.normal(keys[3], (b, k - 1, c)).astype(jnp.bfloat16)
    seq = state_seq = None
    if documents:
        seq = jnp.cumsum(jax.random.uniform(keys[4], (b, l)) < 0.01, axis=1).astype(jnp.int32)
        state_seq = jnp.zeros((b, k - 1), jnp.int32)
    cotangent = jax.random.normal(keys[4], (b, l, c)).astype(jnp.bfloat16)

    def vjp(f):
        out, pull = jax.vjp(lambda *a: f(*a, seq, state_seq), x, kernel, bias, state)
        return out, pull(cotangent)

    def kernels(x, *a):
        y = causal_conv1d_pallas(x, *a, silu=silu, start=start, parts=parts, interpret=False)
        return y if parts is None else jnp.concatenate(y, axis=-1)

    def definition(x, *a):
        return conv_by_definition(x[..., start : start + c], *a, silu=silu)

    ours = jax.jit(lambda: vjp(kernels))()
    want = jax.jit(lambda: vjp(definition))()
    for a, e in zip(jax.tree.leaves(ours), jax.tree.leaves(want), strict=True):
        scale = float(jnp.max(jnp.abs(e.astype(jnp.float32))))
        err = float(jnp.max(jnp.abs(a.astype(jnp.float32) - e.astype(jnp.float32))))
        assert err <= TOL[jnp.bfloat16]["atol"] * scale


def test_impl_is_checked(monkeypatch):
    """An unknown impl, the kernels asked for rows they do not take, and asked for on a TPU (they
    are Triton's), each refuse by name."""
    x, kernel, bias, state, _, _ = inputs(11, 4, jnp.float32, documents=False)
    with pytest.raises(ValueError, match="'xla'"):
        causal_conv1d(x, kernel, bias, state, impl="xla")
    with pytest.raises(ValueError, match="conv impl 'pallas'.*got l=11, k=4"):
        causal_conv1d(x, kernel, bias, state, impl="pallas")
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    with pytest.raises(ValueError, match="Triton .GPU. kernels only; on a TPU use 'auto'"):
        causal_conv1d(x, kernel, bias, state, impl="pallas")
