"""Mixers and the LM: recurrent step == parallel, pieces == whole, fast == reference grads, packing,
causality."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from mixer_testing import (
    assert_lm_decode_equals_parallel,
    assert_trees_close,
    perturbed_mixer,
    prefill_then_decode,
    random_inputs,
    run_parallel,
)

from hax_jax.config import Mamba2Config, MambaConfig, ModelConfig
from hax_jax.models.blocks import MIXERS

TOL = {jnp.float32: dict(atol=2e-5, rtol=2e-5), jnp.bfloat16: dict(atol=5e-2, rtol=5e-2)}
GRAD_TOL = dict(atol=1e-4, rtol=1e-4)  # fp32 gradients of two exact algorithms


def _cfg(kind: str, **kw) -> ModelConfig:
    """A small config of one mixer kind; Mamba-2 with 2 groups and chunks that do not divide l."""
    return ModelConfig(
        d_model=32,
        n_layer=2,
        vocab_size=50,
        block_pattern=(kind,),
        mamba=MambaConfig(d_state=8, d_conv=4),
        mamba2=Mamba2Config(d_state=8, headdim=8, ngroups=2, chunk_size=8, d_conv=4),
        **kw,
    )


def _mixer(kind: str, seed: int = 0, **kw):
    """A mixer with every parameter moved off its init, so structure cannot hide errors."""
    return perturbed_mixer(kind, _cfg(kind, **kw), seed)


@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_step_equals_parallel(kind):
    mixer = _mixer(kind)
    u = random_inputs()
    full, final_cache = run_parallel(mixer, u)
    # Prefill 7 tokens in parallel, then decode the rest one token at a time.
    decoded, cache = prefill_then_decode(mixer, u, prefix=7)
    np.testing.assert_allclose(decoded, full, **TOL[jnp.float32])
    assert_trees_close(cache, final_cache, TOL[jnp.float32])


@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_pieces_equal_whole(kind):
    mixer = _mixer(kind)
    u = random_inputs(l=23)
    full, _ = run_parallel(mixer, u)
    cache, outs = None, []
    for lo, hi in ((0, 2), (2, 11), (11, 23)):  # pieces shorter than the conv window and the chunk
        y, cache = run_parallel(mixer, u[:, lo:hi], cache)
        outs.append(y)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, **TOL[jnp.float32])


@pytest.mark.parametrize(
    "kind, fast, slow",
    [
        (
            "mamba",
            dict(mamba=MambaConfig(d_state=8, scan_impl="associative")),
            dict(mamba=MambaConfig(d_state=8, scan_impl="reference")),
        ),
        (
            "mamba2",
            dict(
                mamba2=Mamba2Config(
                    d_state=8, headdim=8, ngroups=2, chunk_size=8, ssd_impl="chunked"
                )
            ),
            dict(
                mamba2=Mamba2Config(
                    d_state=8, headdim=8, ngroups=2, chunk_size=8, ssd_impl="reference"
                )
            ),
        ),
    ],
)
def test_fast_path_gradients_equal_reference(kind, fast, slow):
    """Values and gradients (inputs and every parameter) of the fast scan match the reference
    scan."""
    u = random_inputs(l=21)
    weights = jax.random.normal(jax.random.key(5), u.shape)

    def grads(overrides):
        mixer = MIXERS[kind](dataclasses.replace(_cfg(kind), **overrides), rngs=nnx.Rngs(0))
        nnx.update(mixer, nnx.state(_mixer(kind)))  # the same perturbed weights for both impls
        graphdef, params = nnx.split(mixer)

        def loss(params, u):
            y, _ = nnx.merge(graphdef, params)(u)
            return jnp.sum(y * weights)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, u)

    (v_fast, g_fast), (v_slow, g_slow) = grads(fast), grads(slow)
    np.testing.assert_allclose(v_fast, v_slow, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g_fast), jax.tree.leaves(g_slow)):
        np.testing.assert_allclose(a, b, **GRAD_TOL)


@pytest.mark.parametrize(
    "kind, field, kernel_name",
    [
        ("mamba", "conv_impl", "causal_conv1d_fwd"),
        ("mamba2", "conv_impl", "causal_conv1d_fwd"),
        ("mamba2", "norm_impl", "gated_norm_fwd"),
        ("mamba", "scan_impl", "pallas_call"),  # the scan reading its gate in place in [x | z]
    ],
)
def test_kernels_in_the_mixer_equal_xla(kind, field, kernel_name):
    """`conv_impl` / `norm_impl` / `scan_impl` "pallas" (the conv's, the gated norm's or the
    selective scan's kernels, interpreted here, each reading in_proj's output in place: the conv
    its x (B, C), the norm and the scan their gate z)
    gives the mixer's values and gradients of "reference" (XLA); the config's choice reaches the
    layer (the kernels' custom call is in one program and not the other)."""
    u = random_inputs(l=64)  # two of the kernels' 32-row chunks
    weights = jax.random.normal(jax.random.key(6), u.shape)

    def run(impl):
        cfg = _cfg(kind)
        cfg = dataclasses.replace(
            cfg, **{kind: dataclasses.replace(getattr(cfg, kind), **{field: impl})}
        )
        mixer = MIXERS[kind](cfg, rngs=nnx.Rngs(0))
        nnx.update(mixer, nnx.state(_mixer(kind)))
        graphdef, params = nnx.split(mixer)

        def loss(params, u):
            y, _ = nnx.merge(graphdef, params)(u)
            return jnp.sum(y * weights)

        jaxpr = str(jax.make_jaxpr(jax.grad(loss))(params, u))
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, u), jaxpr

    ((v_fast, g_fast), fast_jaxpr), ((v_slow, g_slow), slow_jaxpr) = run("pallas"), run("reference")
    assert kernel_name in fast_jaxpr and kernel_name not in slow_jaxpr
    np.testing.assert_allclose(v_fast, v_slow, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g_fast), jax.tree.leaves(g_slow), strict=True):
        np.testing.assert_allclose(a, b, **GRAD_TOL)


@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_causal(kind):
    """d out_i / d u_j == 0 exactly for j > i."""
    mixer = _mixer(kind)
    u = random_inputs(b=1, l=12)
    i = 5
    grad = nnx.jit(jax.grad(lambda u, m: jnp.sum(m(u)[0][:, i])))(u, mixer)
    assert np.all(np.asarray(grad[:, i + 1 :]) == 0.0)
    assert np.any(np.asarray(grad[:, : i + 1]) != 0.0)


def test_mamba2_packed_documents_equal_separate_runs():
    mixer = _mixer("mamba2")
    u = random_inputs(b=1, l=22)
    bounds = [
        (0, 5),
        (5, 16),
        (16, 17),
        (17, 22),
    ]  # inside chunks, on none of their edges, length 1
    seq_idx = jnp.concatenate(
        [jnp.full((1, hi - lo), i, jnp.int32) for i, (lo, hi) in enumerate(bounds)], 1
    )
    packed, cache = run_parallel(mixer, u, seq_idx=seq_idx)
    separate = jnp.concatenate([run_parallel(mixer, u[:, lo:hi])[0] for lo, hi in bounds], 1)
    np.testing.assert_allclose(packed, separate, **TOL[jnp.float32])
    # The cache continues the last document only.
    _, last_cache = run_parallel(mixer, u[:, 17:22])
    for got, want in zip(jax.tree.leaves(cache), jax.tree.leaves(last_cache), strict=True):
        np.testing.assert_allclose(got, want, **TOL[jnp.float32])


def test_mamba_rejects_seq_idx():
    with pytest.raises(ValueError, match="seq_idx .* mamba2 layers only"):
        _mixer("mamba")(random_inputs(), seq_idx=jnp.zeros((2, 19), jnp.int32))


@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_bfloat16_compute_close_to_float32(kind):
    u = random_inputs()
    y32, _ = run_parallel(_mixer(kind), u)
    y16, _ = run_parallel(_mixer(kind, dtype="bfloat16"), u.astype(jnp.bfloat16))
    assert y16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y16, np.float32), y32, **TOL[jnp.bfloat16])


def test_lm_decode_equals_parallel_for_a_hybrid():
    cfg = dataclasses.replace(
        _cfg("mamba"), block_pattern=("mamba2", "mamba"), n_layer=4, tie_embeddings=False
    )
    assert_lm_decode_equals_parallel(cfg, TOL[jnp.float32])


def test_mamba2_ssd_mosaic_gpu_reaches_the_kernels():
    """model.mamba2.ssd_mosaic_gpu is the SSD kernels' BlockSizes.mosaic_gpu: forced on fp32
    inputs (which Mosaic GPU does not take) it is refused by the kernel, False runs Triton's;
    with a pure-JAX ssd_impl it is refused at config time, naming both settings."""
    base = _cfg("mamba2").mamba2
    forced = dataclasses.replace(base, ssd_impl="pallas", ssd_mosaic_gpu=True, chunk_size=16)
    with pytest.raises(ValueError, match="mosaic_gpu=True"):
        perturbed_mixer("mamba2", dataclasses.replace(_cfg("mamba2"), mamba2=forced), 0)(
            random_inputs()
        )
    triton = dataclasses.replace(forced, ssd_mosaic_gpu=False)
    y, _ = perturbed_mixer("mamba2", dataclasses.replace(_cfg("mamba2"), mamba2=triton), 0)(
        random_inputs()
    )
    assert np.all(np.isfinite(np.asarray(y)))
    with pytest.raises(ValueError, match="ssd_mosaic_gpu=False.*ssd_impl='chunked'"):
        dataclasses.replace(base, ssd_impl="chunked", ssd_mosaic_gpu=False)
