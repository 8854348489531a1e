"""Tests for impl="pallas" of the Mamba-1 selective scan: the kernels against the definition.

On CPU the gpu variant runs in Pallas interpret mode and the tpu variant in TPU interpret mode
(tiny shapes only); both are cross-lowered for "cuda" and "tpu" at a realistic shape, which
catches unsupported primitives and bad block shapes of the compiled kernels. The gpu-marked
tests run the compiled Triton kernels against the reference.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxprs import sub_jaxprs
from kernel_checks import (
    COMPILED,
    SCAN_OPTIONAL,
    assert_close,
    largest_array,
    selective_scan_inputs,
)

from pallas_kernels.backend import lower_for
from pallas_kernels.selective_scan import BlockSizes, saved_states_bytes, selective_scan

jax.config.update("jax_enable_x64", False)

# Declared once per dtype. fp32: both sides compute in fp32 (exp2 vs exp, other summation
# orders). bf16: outputs and gradients are rounded to bf16 once on each side (1 ulp = 2^-7).
TOL = {jnp.float32: dict(atol=1e-5, rtol=1e-5), jnp.bfloat16: dict(atol=1e-2, rtol=1e-2)}
GRAD_TOL = {jnp.float32: dict(atol=1e-4, rtol=1e-4), jnp.bfloat16: dict(atol=1e-2, rtol=1e-2)}


def run(inputs, **kwargs):
    """(y, final_state) of selective_scan on a dict of inputs (None entries dropped)."""
    opt = {k: inputs[k] for k in SCAN_OPTIONAL if inputs[k] is not None}
    pos = [inputs[k] for k in ("x", "dt", "A", "B", "C")]
    return selective_scan(*pos, **opt, return_final_state=True, **kwargs)


def outputs_and_grads(inputs, seed=1, **kwargs):
    """y, final state and the vjp of a random cotangent of both, for every present input."""
    present = {k: v for k, v in inputs.items() if v is not None}
    y, h = run(inputs, **kwargs)
    rng = np.random.default_rng(seed)
    dy = jnp.asarray(rng.standard_normal(y.shape), y.dtype)
    dh = jnp.asarray(rng.standard_normal(h.shape), h.dtype)

    @jax.jit
    def grads(present):
        """Cotangents of every present input."""
        _, vjp = jax.vjp(lambda p: run(dict(inputs, **p), **kwargs), present)
        return vjp((dy, dh))[0]

    return y, h, grads(present)


def check_against_reference(inputs, dtype, **kwargs):
    """Pallas y, final state and gradients equal the reference's (same dtypes, finite)."""
    y, h, g = outputs_and_grads(inputs, impl="pallas", **kwargs)
    y_ref, h_ref, g_ref = outputs_and_grads(inputs, impl="reference")
    assert y.dtype == inputs["x"].dtype and h.dtype == jnp.float32
    assert_close(y, y_ref, TOL[dtype], "y")
    assert_close(h, h_ref, TOL[jnp.float32 if dtype == jnp.bfloat16 else dtype], "final state")
    assert g.keys() == g_ref.keys()
    for name in g:
        assert g[name].dtype == inputs[name].dtype, name
        assert np.all(np.isfinite(np.asarray(g[name], np.float32))), name
        assert_close(g[name], g_ref[name], GRAD_TOL[dtype], name)


@pytest.mark.parametrize(
    "shape, dtype, sizes, optional",
    [
        # l = 37: not a multiple of the chunks; d = 20: not of block_d; n = 5: padded to 8
        ((2, 37, 20, 5), jnp.float32, BlockSizes(chunk=8, chunk_bwd=4, block_d=8), SCAN_OPTIONAL),
        # no optional input; the backward blocks channels differently from the forward
        ((1, 16, 8, 4), jnp.float32, BlockSizes(chunk=8, block_d_bwd=4), ()),
        ((2, 21, 12, 16), jnp.bfloat16, BlockSizes(chunk=8, chunk_bwd=4, block_d=4), SCAN_OPTIONAL),
    ],
)
def test_gpu_variant_matches_reference(shape, dtype, sizes, optional):
    """The gpu (Triton) kernels, interpreted: values and gradients of every input."""
    inputs = selective_scan_inputs(*shape, dtype=dtype, optional=optional)
    check_against_reference(inputs, dtype, variant="gpu", interpret=True, block_sizes=sizes)


@pytest.mark.parametrize("impl", ["pallas", "associative"])
@pytest.mark.parametrize(
    "l, z_start, in_place",
    [(32, 16, True), (32, 0, True), (37, 16, False), (32, 4, False)],  # [x | z]; [z | more];
    # a length the chunks pad; a start inside a channel block: both sliced
)
def test_a_wider_gate_is_its_channels_from_z_start(impl, l, z_start, in_place):
    """z (b, l, 40) with the gate at channels z_start .. z_start + 16 (in_proj's whole output
    [x | z] for z_start = d): the scan gated by those channels, values and gradients, z's other
    channels taking zeros; read in place by the gpu kernels (interpreted) where no padding is
    needed and z_start is a whole number of channel blocks (no slice traced), else sliced."""
    inputs = selective_scan_inputs(2, l, 16, 4, optional=("D", "initial_state"))
    wide = jax.random.normal(jax.random.key(5), (2, l, 40))
    sizes = BlockSizes(chunk=8, chunk_bwd=4, block_d=8)
    kwargs = dict(impl=impl, variant="gpu", interpret=True, block_sizes=sizes)
    if impl == "associative":
        kwargs = dict(impl=impl)
    got = outputs_and_grads(dict(inputs, z=wide), z_start=z_start, **kwargs)
    y, h, g = outputs_and_grads(dict(inputs, z=wide[..., z_start : z_start + 16]), **kwargs)
    g["z"] = jnp.pad(g["z"], [(0, 0), (0, 0), (z_start, 40 - z_start - 16)])
    for name, a, b in zip(("y", "h", "grads"), got, (y, h, g)):
        for leaf_a, leaf_b in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            assert leaf_a.shape == leaf_b.shape, name
            assert_close(leaf_a, leaf_b, TOL[jnp.float32], name)
    if impl == "pallas":
        scan = functools.partial(selective_scan, z_start=z_start, **kwargs)
        args = [inputs[k] for k in ("x", "dt", "A", "B", "C")]
        jaxpr = jax.make_jaxpr(lambda *a: scan(*a, z=wide))(*args)
        assert (_slices_of(jaxpr.jaxpr, wide.shape) > 0) == (not in_place)


def _slices_of(jaxpr, shape) -> int:
    """How many slices of a `shape` array the program takes outside its kernels' bodies."""
    count = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            continue
        if eqn.primitive.name == "slice" and eqn.invars[0].aval.shape == shape:
            count += 1
        count += sum(_slices_of(sub, shape) for sub in sub_jaxprs(eqn))
    return count


def test_recomputed_states_are_not_kept_and_change_no_gradient():
    """recompute_states=True: what the backward keeps from the forward (the vjp's residuals) has
    no saved-states array, (b, l / chunk_bwd, d, n) fp32, where the default's has one; the
    gradients equal the default's exactly (the same kernels on the same states) and the
    reference's within tolerance. (ops.py does the recompute for either variant alike.)"""
    inputs = selective_scan_inputs(2, 37, 20, 5, optional=SCAN_OPTIONAL)
    sizes = BlockSizes(chunk=8, chunk_bwd=4, block_d=8)
    kwargs = dict(variant="gpu", interpret=True, block_sizes=sizes)
    present = {k: v for k, v in inputs.items() if v is not None}
    kept = {}
    for recompute in (False, True):
        fn = functools.partial(run, impl="pallas", recompute_states=recompute, **kwargs)
        _, vjp = jax.vjp(lambda p: fn(dict(inputs, **p)), present)  # noqa: B023
        kept[recompute] = {leaf.shape for leaf in jax.tree.leaves(vjp) if leaf.ndim == 4}
        assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(vjp) if leaf.ndim == 4)
    assert len(kept[False]) == 1 and kept[True] == set()
    (states,) = kept[False]
    assert np.prod(states) * 4 == saved_states_bytes(2, 37, 20, 5, variant="gpu", block_sizes=sizes)
    y, h, g = outputs_and_grads(inputs, impl="pallas", recompute_states=True, **kwargs)
    y_saved, h_saved, g_saved = outputs_and_grads(inputs, impl="pallas", **kwargs)
    for name in g:
        np.testing.assert_array_equal(g[name], g_saved[name], err_msg=name)
    np.testing.assert_array_equal(y, y_saved)
    np.testing.assert_array_equal(h, h_saved)
    check_against_reference(inputs, jnp.float32, recompute_states=True, **kwargs)


def test_gpu_bf16_partials_err_like_rounding_twice():
    """bf16 B / C: the gpu backward's dB / dC come from bf16 per-channel-block partials; their
    error against the exact gradient (fp32 reference on the same values) stays under twice
    that of the exact gradient rounded to bf16 (relative rms; measured 1.6x)."""
    inputs = selective_scan_inputs(
        2, 24, 64, 16, seed=3, dtype=jnp.bfloat16
    )  # 16 blocks of 4 channels
    sizes = BlockSizes(chunk=8, chunk_bwd=4, block_d=4)
    dy = jnp.asarray(np.random.default_rng(5).standard_normal((2, 24, 64)), jnp.bfloat16)

    def grads_bc(inputs, **kwargs):
        """dB, dC of sum(y * dy) in fp32."""
        loss = lambda B, C: jnp.sum(  # noqa: E731
            run(dict(inputs, B=B, C=C), **kwargs)[0].astype(jnp.float32) * dy
        )
        return [np.asarray(g, np.float32) for g in jax.grad(loss, (0, 1))(inputs["B"], inputs["C"])]

    pallas = grads_bc(inputs, impl="pallas", variant="gpu", interpret=True, block_sizes=sizes)
    upcast = {k: v.astype(jnp.float32) for k, v in inputs.items()}
    exact = grads_bc(upcast, impl="reference")
    for name, got, want in zip("BC", pallas, exact, strict=True):
        rel_rms = np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2))
        rounded = np.asarray(jnp.asarray(want).astype(jnp.bfloat16), np.float32)
        rounding = np.sqrt(np.mean((rounded - want) ** 2) / np.mean(want**2))
        assert rel_rms < 2 * rounding, (name, rel_rms, rounding)


def test_gpu_variant_without_final_state():
    """return_final_state=False gives the same y (the final-state cotangent is then zero)."""
    inputs = selective_scan_inputs(1, 9, 3, 2, seed=4)
    opt = {k: inputs[k] for k in SCAN_OPTIONAL}
    pos = [inputs[k] for k in ("x", "dt", "A", "B", "C")]
    pallas = functools.partial(selective_scan, impl="pallas", variant="gpu", interpret=True)
    y = pallas(*pos, **opt)
    assert_close(y, selective_scan(*pos, **opt, impl="reference"), TOL[jnp.float32])
    grad = jax.grad(lambda x: jnp.sum(pallas(x, *pos[1:], **opt) ** 2))(pos[0])
    grad_ref = jax.grad(
        lambda x: jnp.sum(selective_scan(x, *pos[1:], **opt, impl="reference") ** 2)
    )(pos[0])
    assert_close(grad, grad_ref, GRAD_TOL[jnp.float32])


def test_tpu_variant_matches_reference():
    """The tpu (Mosaic) kernels in TPU interpret mode on a small shape: 20 steps in chunks of
    16 (forward) and 8 (backward), d = 136 in two blocks of 128 lanes, n = 5 padded to 8."""
    inputs = selective_scan_inputs(1, 20, 136, 5, seed=2)
    sizes = BlockSizes(chunk=16, chunk_bwd=8)
    check_against_reference(inputs, jnp.float32, variant="tpu", interpret=True, block_sizes=sizes)


def _realistic_args(b=2, l=2048, d=1536, n=16):
    """Abstract bf16 inputs of a Mamba-1 layer's scan (A, D, initial_state fp32)."""
    sds = jax.ShapeDtypeStruct
    bf16, f32 = jnp.bfloat16, jnp.float32
    seq, bc = sds((b, l, d), bf16), sds((b, l, n), bf16)
    return dict(
        x=seq,
        dt=seq,
        A=sds((d, n), f32),
        B=bc,
        C=bc,
        D=sds((d,), f32),
        z=seq,
        initial_state=sds((b, d, n), f32),
    )


@pytest.mark.parametrize(
    "platform, variant, whole",
    [("cuda", "gpu", False), ("cuda", "gpu", True), ("tpu", "tpu", True)],
)
def test_cross_lowering(platform, variant, whole):
    """Forward and forward+backward lower for the variant's compiler at (b2, l2048, d1536,
    n16) bf16: every primitive has a Triton / Mosaic lowering, every block shape is legal;
    `whole`: z is in_proj's whole output [x | z] (b, l, 2d), the gate from channel d."""
    z_start = 1536 if whole else 0

    def forward(inputs):
        """y and final state, compiled (not interpreted)."""
        return run(inputs, impl="pallas", variant=variant, interpret=False, z_start=z_start)

    def grads(inputs):
        """Gradients of a loss of both outputs."""
        y, h = forward(inputs)
        return jax.grad(lambda i: jnp.sum(forward(i)[0].astype(jnp.float32)) + jnp.sum(h))(inputs)

    args = _realistic_args()
    if whole:
        args["z"] = jax.ShapeDtypeStruct((2, 2048, 2 * 1536), jnp.bfloat16)
    call = "__gpu$xla.gpu.triton" if platform == "cuda" else "tpu_custom_call"
    for fn, kernels in ((forward, 1), (grads, 2)):
        text = lower_for(platform, fn, args)
        assert text.count(call) >= kernels, fn.__name__


def test_no_state_sequence_is_materialized():
    """Forward + backward never produce a (b, l, d, n) array: the residual is one state per
    chunk_bwd steps."""
    b, l, d, n = 1, 256, 8, 16
    args = _realistic_args(b, l, d, n)

    def loss(inputs):
        """Sum of both outputs."""
        y, h = run(inputs, impl="pallas", variant="gpu", interpret=True)
        return jnp.sum(y.astype(jnp.float32)) + jnp.sum(h)

    assert largest_array(jax.make_jaxpr(jax.grad(loss))(args).jaxpr) < b * l * d * n


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(variant="cuda"), "variant must be one of"),
        (dict(block_sizes=(8,)), "block_sizes must be a BlockSizes"),
        (dict(recompute_states="yes"), "recompute_states must be a bool, got 'yes'"),
        (dict(block_sizes=BlockSizes(block_d=24)), "block_d must be a power of two"),
        (dict(block_sizes=BlockSizes(chunk=0)), "chunk must be a positive int"),
        (dict(block_sizes=BlockSizes(chunk=8, chunk_bwd=16)), "chunk_bwd must divide chunk"),
        (dict(variant="tpu", block_sizes=BlockSizes(block_d=64)), "multiple of 128 on tpu"),
        (dict(variant="tpu", block_sizes=BlockSizes(chunk=12)), "multiple of 8 on tpu"),
    ],
)
def test_bad_pallas_arguments_raise(kwargs, match):
    """Bad variant or block sizes raise ValueError naming the value."""
    with pytest.raises(ValueError, match=match):
        run(selective_scan_inputs(1, 7, 3, 2), impl="pallas", interpret=True, **kwargs)


def test_float64_is_refused():
    """impl='pallas' computes in fp32: a float64 input is an error naming it."""
    with jax.enable_x64(True):
        inputs = selective_scan_inputs(1, 7, 3, 2)
        inputs["dt"] = inputs["dt"].astype(jnp.float64)
        with pytest.raises(ValueError, match="dt is float64"):
            run(inputs, impl="pallas", interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype, recompute", [(jnp.float32, False), (jnp.bfloat16, False), (jnp.bfloat16, True)]
)
def test_compiled_gpu_kernels_match_reference(dtype, recompute, monkeypatch):
    """The compiled Triton kernels at (b2, l1024, d512, n16): values and gradients, also with the
    backward's states recomputed."""
    monkeypatch.setitem(COMPILED, "on", True)
    inputs = selective_scan_inputs(2, 1024, 512, 16, seed=3, dtype=dtype)
    check_against_reference(inputs, dtype, variant="gpu", recompute_states=recompute)
