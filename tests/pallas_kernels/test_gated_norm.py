"""The gated RMSNorm's Triton kernels (pallas_kernels/gated_norm) against its definition
(reference.py): output and the gradients of y, z and the weight, interpreted on a CPU, lowered for
CUDA, and compiled where a GPU is present."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels.gated_norm.kernel as gated_kernel
from pallas_kernels.backend import lower_for
from pallas_kernels.gated_norm import gated_rms_norm, gated_rms_norm_reference

# Per dtype of y / z, once: fp32 sums reordered; bf16 results rounded to bf16 once.
TOL = {jnp.float32: dict(atol=2e-5, rtol=2e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}
EPS = 1e-5


def _inputs(shape, dtype, gate, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    y = jax.random.normal(keys[0], shape).astype(dtype)
    z = jax.random.normal(keys[1], shape).astype(dtype) if gate else None
    weight = 1.0 + 0.1 * jax.random.normal(keys[2], shape[-1:])
    cotangent = jax.random.normal(keys[3], shape).astype(dtype)
    return y, z, weight, cotangent


def _vjp(norm, y, z, weight, cotangent):
    out, pull = jax.vjp(norm, y, z, weight)
    return out, pull(cotangent)


def _assert_matches(shape, group_size, dtype, gate, interpret=True):
    y, z, weight, cotangent = _inputs(shape, dtype, gate)
    ours = _vjp(
        lambda y, z, w: gated_rms_norm(
            y, z, w, group_size=group_size, eps=EPS, impl="pallas", interpret=interpret
        ),
        y,
        z,
        weight,
        cotangent,
    )
    want = _vjp(
        lambda y, z, w: gated_rms_norm_reference(y, z, w, group_size=group_size, eps=EPS),
        y,
        z,
        weight,
        cotangent,
    )
    names = ("out", "dy", "dz", "dweight") if gate else ("out", "dy", "dweight")
    got_leaves, want_leaves = jax.tree.leaves(ours), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves) == len(names)
    for name, got, expected in zip(names, got_leaves, want_leaves, strict=True):
        assert got.dtype == expected.dtype and got.shape == expected.shape, name
        np.testing.assert_allclose(
            got.astype(np.float32), expected.astype(np.float32), err_msg=name, **TOL[dtype]
        )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("gate", [True, False])
@pytest.mark.parametrize(
    "shape, group_size",
    [
        ((2, 37, 48), 48),  # one group, not a power of two: a 64-wide tile, 16 columns masked
        ((2, 37, 48), 12),  # four groups of 12
        ((3, 11, 32), 32),  # a power of two
    ],
)
def test_interpreted_kernels_equal_the_definition(monkeypatch, dtype, gate, shape, group_size):
    # Few programs, so each runs several rows and the last block is partly past the rows.
    monkeypatch.setattr(gated_kernel, "PROGRAMS", 5)
    assert gated_kernel.tiling(shape[0] * shape[1], group_size)[0] > 1
    _assert_matches(shape, group_size, dtype, gate)


def _assert_added_matches(impl, dtype, gate, shape, group_size, interpret=True):
    """added = (o, gain): the norm of y + o * gain (HAX's branch), output and the gradients of
    y, z, weight, o and gain, against the norm of that sum formed outside."""
    y, z, weight, cotangent = _inputs(shape, dtype, gate)
    keys = jax.random.split(jax.random.key(7), 2)
    o = jax.random.normal(keys[0], shape).astype(dtype)
    gain = jax.random.normal(keys[1], shape[-1:])

    def ours(y, z, weight, o, gain):
        return gated_rms_norm(
            y,
            z,
            weight,
            group_size=group_size,
            eps=EPS,
            added=(o, gain),
            impl=impl,
            interpret=interpret,
        )

    def definition(y, z, weight, o, gain):
        u = y.astype(jnp.float32) + o.astype(jnp.float32) * gain
        return gated_rms_norm_reference(u, z, weight, group_size=group_size, eps=EPS).astype(
            y.dtype
        )

    def vjp(f):
        out, pull = jax.vjp(f, y, z, weight, o, gain)
        return out, pull(cotangent)

    got, want = (
        jax.tree.leaves(jax.jit(vjp, static_argnums=0)(ours)),
        jax.tree.leaves(vjp(definition)),
    )
    names = ["out", "dy", "dz", "dweight", "do", "dgain"]
    if not gate:
        names.remove("dz")
    assert len(got) == len(want) == len(names)
    for name, a, e in zip(names, got, want, strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape, name
        np.testing.assert_allclose(
            a.astype(np.float32), e.astype(np.float32), err_msg=name, **TOL[dtype]
        )


@pytest.mark.parametrize("impl", ["reference", "pallas"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("gate", [True, False])
def test_added_branch_is_the_norm_of_the_sum(monkeypatch, impl, dtype, gate):
    monkeypatch.setattr(gated_kernel, "PROGRAMS", 5)  # several rows a program, as above
    _assert_added_matches(impl, dtype, gate, (2, 37, 48), 12)


@pytest.mark.parametrize("gate", [True, "wide", False])  # wide: z read in place in (.., 3352)
@pytest.mark.parametrize("added", [False, True])
def test_lowers_for_cuda(gate, added):
    y, z, weight, _ = _inputs((2, 64, 1536), jnp.bfloat16, gate)
    if gate == "wide":
        z = jnp.concatenate([z, jnp.zeros((2, 64, 1816), z.dtype)], axis=-1)
    o, gain = (y, weight) if added else (None, None)

    def loss(y, z, w, o, gain):
        out = gated_rms_norm(
            y,
            z,
            w,
            group_size=1536,
            eps=EPS,
            added=None if o is None else (o, gain),
            impl="pallas",
            interpret=False,
        )
        return jnp.sum(out.astype(jnp.float32))

    argnums = (0, 1, 2) if gate else (0, 2)
    argnums += (3, 4) if added else ()
    text = lower_for("cuda", jax.grad(loss, argnums=argnums), y, z, weight, o, gain)
    assert "triton" in text and "gated_norm_fwd" in text and "gated_norm_bwd" in text


@pytest.mark.parametrize("impl", ["reference", "pallas"])
@pytest.mark.parametrize(
    "e, group_size, in_place",
    [(48, 48, True), (32, 16, True), (36, 12, False)],  # one group; 2 of 16; 3 of 12: sliced
)
def test_a_wider_gate_is_its_first_channels(monkeypatch, impl, e, group_size, in_place):
    """z (..., e + 20), as in_proj's whole output: the norm of y gated by z's first e channels,
    read in place by the kernels where the groups allow (no slice traced), and z's gradient that
    of those channels with zeros after."""
    monkeypatch.setattr(gated_kernel, "PROGRAMS", 5)  # several rows a program
    y, _, weight, cotangent = _inputs((2, 37, e), jnp.float32, False)
    wide = jax.random.normal(jax.random.key(9), (2, 37, e + 20))

    def norm(y, z, w):
        return gated_rms_norm(y, z, w, group_size=group_size, eps=EPS, impl=impl)

    got = _vjp(norm, y, wide, weight, cotangent)
    out, (dy, dz, dw) = _vjp(norm, y, wide[..., :e], weight, cotangent)
    want = (out, (dy, jnp.pad(dz, [(0, 0), (0, 0), (0, 20)]), dw))
    for name, a, b in zip(("out", "dy", "dz", "dweight"), *map(jax.tree.leaves, (got, want))):
        assert a.shape == b.shape, name
        np.testing.assert_allclose(a, b, err_msg=name, **TOL[jnp.float32])
    if impl == "pallas":
        jaxpr = str(jax.make_jaxpr(norm)(y, wide, weight))
        assert ("slice" in jaxpr) == (not in_place)


def test_auto_is_the_definition_on_a_cpu():
    y, z, weight, _ = _inputs((2, 5, 8), jnp.float32, True)
    np.testing.assert_array_equal(
        gated_rms_norm(y, z, weight, group_size=4, eps=EPS),
        gated_rms_norm_reference(y, z, weight, group_size=4, eps=EPS),
    )


def test_bad_inputs_are_named():
    y, z, weight, _ = _inputs((2, 5, 8), jnp.float32, True)
    with pytest.raises(ValueError, match="group_size must divide the last axis, 8; got 3"):
        gated_rms_norm(y, z, weight, group_size=3, eps=EPS)
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\)"):
        gated_rms_norm(y, z, weight[:4], group_size=4, eps=EPS)
    with pytest.raises(ValueError, match=r"z must have y's shape \(2, 5, 8\) or more channels"):
        gated_rms_norm(y, z[..., :4], weight, group_size=4, eps=EPS)
    with pytest.raises(ValueError, match="impl must be one of"):
        gated_rms_norm(y, z, weight, group_size=4, eps=EPS, impl="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape, group_size", [((2, 1000, 1536), 1536), ((3, 700, 4096), 1024)])
def test_compiled_on_gpu(dtype, shape, group_size):
    _assert_matches(shape, group_size, dtype, gate=True, interpret=False)


@pytest.mark.gpu
def test_added_compiled_on_gpu():
    _assert_added_matches("pallas", jnp.bfloat16, True, (2, 1000, 1536), 1536, interpret=False)


@pytest.mark.parametrize(
    "data, seq, tensor",
    [(2, 2, 2), (1, 1, 4), (4, 2, 1)],  # tensor=4 splits the two groups: left to XLA
)
def test_the_layer_per_device_equals_one_device(data, seq, tensor):
    """GatedRMSNorm's kernels (interpreted) per device under a mesh: the output and gradients of
    one device's definition."""
    from hax_jax import sharding
    from hax_jax.config import MeshConfig
    from hax_jax.layers.norms import GatedRMSNorm

    y, z, _, cotangent = _inputs((4, 8, 16), jnp.float32, True)
    weight = 1.0 + 0.1 * jnp.arange(16.0)

    def vjp(y, z, weight):
        def apply(y, z, weight):
            layer = GatedRMSNorm(16, group_size=8, impl="pallas")
            layer.weight[...] = weight
            return layer(y, z)

        out, pull = jax.vjp(apply, y, z, weight)
        return out, pull(cotangent)

    mesh = sharding.make_mesh(MeshConfig(data=data, seq=seq, tensor=tensor), jax.devices("cpu"))
    with jax.set_mesh(mesh):
        got = jax.jit(vjp)(y, z, weight)
        jaxpr = str(jax.make_jaxpr(vjp)(y, z, weight))
    assert ("pallas_call" in jaxpr) == (tensor <= 2)  # two groups: split over at most two devices
    want = _vjp(
        lambda y, z, w: gated_rms_norm_reference(y, z, w, group_size=8, eps=1e-5),
        y,
        z,
        weight,
        cotangent,
    )
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, **TOL[jnp.float32])
