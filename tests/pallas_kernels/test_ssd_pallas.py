"""The Pallas SSD kernels (impl="pallas") against the pure-JAX chunked path: values and gradients.

On CPU the kernels run in Pallas interpret mode (the gpu variant; the tpu variant in TPU
interpret mode at a tiny shape); both are also cross-lowered for "cuda" and "tpu" at a
realistic shape. The gpu-marked tests run the compiled Triton kernels.
"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.backend import lower_for
from pallas_kernels.ssd import BlockSizes, ssd, state_passing
from pallas_kernels.ssd.tiling import resolve_block_sizes

# Max abs error relative to the largest reference magnitude, per input dtype (forward and every
# gradient). bf16: the kernels feed bf16 to the matmuls (as mamba_ssm does) while the reference
# computes in fp32 from the same bf16 values.
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}

SEQ_IDX = np.array([[0] * 10 + [1] * 6 + [2] * 21, [3] * 8 + [4] + [7] * 28], np.int32)
NAMES = ("x", "dt", "A", "B", "C", "D", "initial_state")


def make_inputs(b, l, h, p, g, n, dtype, seed=0):
    """Random inputs: x, B, C (and dy) in dtype, dt / A / D / initial state fp32."""
    rng = np.random.default_rng(seed)
    normal = lambda *s: rng.standard_normal(s, np.float32)  # noqa: E731
    inputs = dict(
        x=jnp.asarray(normal(b, l, h, p), dtype),
        dt=jnp.asarray(np.log1p(np.exp(normal(b, l, h) - 1.0))),
        A=jnp.asarray(-np.exp(normal(h))),
        B=jnp.asarray(normal(b, l, g, n), dtype),
        C=jnp.asarray(normal(b, l, g, n), dtype),
        D=jnp.asarray(normal(h)),
        initial_state=jnp.asarray(normal(b, h, p, n)),
    )
    cotangents = (jnp.asarray(normal(b, l, h, p), dtype), jnp.asarray(normal(b, h, p, n)))
    return inputs, cotangents


def value_and_grads(inputs, cotangents, seq_idx, **kw):
    """(y, final state) and the vjp of every input, jitted once per configuration."""

    def f(*args):
        named = dict(zip(NAMES, args))
        return ssd(
            *args[:5],
            D=named["D"],
            initial_state=named["initial_state"],
            seq_idx=seq_idx,
            return_final_state=True,
            **kw,
        )

    def both(*args):
        out, vjp = jax.vjp(f, *args)
        return out, vjp(cotangents)

    return jax.jit(both)(*(inputs[k] for k in NAMES))


def assert_matches(actual, desired, dtype):
    """Every array within TOL[dtype] of the reference, relative to its largest magnitude."""
    for name, a, d in zip(("y", "final") + NAMES, actual, desired):
        a, d = np.asarray(a, np.float32), np.asarray(d, np.float32)
        err = np.max(np.abs(a - d)) / max(np.max(np.abs(d)), 1e-6)
        assert err <= TOL[dtype], f"{name}: relative error {err:.2e} > {TOL[dtype]}"


def flat(out_and_grads):
    (y, final), grads = out_and_grads
    return (y, final, *grads)


@pytest.mark.parametrize(
    "g, seq, dtype, state_rows",
    [
        (1, False, jnp.float32, None),
        (2, True, jnp.float32, 16),
        (1, True, jnp.bfloat16, None),
    ],
)
def test_gpu_variant_interpreted(g, seq, dtype, state_rows):
    """l = 37 pads the last chunk; chunk 16 in tiles of 8 runs the cross-tile loops; p = 3 and
    n = 5 are zero-padded to 16; seq_idx has boundaries inside and on chunk edges. The states
    pass over chunks in programs of 2 rows of p (the default for this small grid) or 16."""
    inputs, cts = make_inputs(2, 37, 4, 3, g, 5, dtype)
    seq_idx = jnp.asarray(SEQ_IDX) if seq else None
    ref = value_and_grads(inputs, cts, seq_idx, chunk_size=16, impl="chunked")
    got = value_and_grads(
        inputs,
        cts,
        seq_idx,
        chunk_size=16,
        impl="pallas",
        variant="gpu",
        block_sizes=BlockSizes(tile=8, tile_bwd=8, heads_per_block=2, state_rows=state_rows),
        interpret=True,
    )
    assert_matches(flat(got), flat(ref), dtype)


@pytest.mark.parametrize(
    "b, h, p, set_to, want",
    [
        (8, 24, 64, None, 16),  # 8 x 2048 of Mamba-2 130M: 768 programs of 16 rows
        (1, 24, 64, None, 2),  # one long row: 96 programs of 16 rows would leave loads waiting
        (2, 80, 64, None, 16),  # 2.7B's 80 heads, two rows
        (1, 80, 64, None, 8),  # one row of them: 640 programs at 8 rows
        (1, 24, 16, None, 2),  # p padded to 16
        (1, 24, 64, 8, 8),  # BlockSizes.state_rows decides when given
        (1, 24, 16, 32, 16),  # at most p
    ],
)
def test_state_rows(b, h, p, set_to, want):
    """Rows of p a state-passing program: 16, halved (down to 2) while the grid has fewer than
    MIN_STATE_PROGRAMS programs."""
    sizes = resolve_block_sizes("gpu", 256, h, BlockSizes(state_rows=set_to))
    assert state_passing._state_rows(types.SimpleNamespace(sizes=sizes), b * h, p) == want


@pytest.mark.parametrize("heads_per_program", [None, 1])
def test_mosaic_gpu_kernels_interpreted(heads_per_program):
    """block_sizes.mosaic_gpu=True: chunk_state / chunk_out by the Mosaic GPU kernels (their
    interpreter), the rest Triton-interpreted; l = 200 pads the second chunk of 128, a document
    boundary inside the first chunk, initial state on; both heads in one program (the default
    here) and one head a program."""
    inputs, cts = make_inputs(1, 200, 2, 64, 1, 64, jnp.bfloat16)
    seq_idx = jnp.asarray(np.repeat([0, 1], [90, 110])[None].astype(np.int32))
    ref = value_and_grads(inputs, cts, seq_idx, chunk_size=128, impl="chunked")
    got = value_and_grads(
        inputs,
        cts,
        seq_idx,
        chunk_size=128,
        impl="pallas",
        variant="gpu",
        block_sizes=BlockSizes(mosaic_gpu=True, heads_per_program=heads_per_program),
    )
    assert_matches(flat(got), flat(ref), jnp.bfloat16)


def test_tpu_variant_interpreted():
    """The Mosaic TPU variant under TPU interpret semantics, tiny shape."""
    inputs, cts = make_inputs(1, 13, 2, 3, 1, 4, jnp.float32)
    ref = value_and_grads(inputs, cts, None, chunk_size=8, impl="chunked")
    got = value_and_grads(
        inputs, cts, None, chunk_size=8, impl="pallas", variant="tpu", interpret=True
    )
    assert_matches(flat(got), flat(ref), jnp.float32)


@pytest.mark.parametrize("variant, platform", [("gpu", "cuda"), ("tpu", "tpu")])
def test_lowers_for_hardware(variant, platform):
    """Forward and backward lower for the real compilers at a Mamba-2 130M-like shape."""
    S = jax.ShapeDtypeStruct
    b, l, h, p, n = 2, 3072, 8, 64, 128
    args = (
        S((b, l, h, p), jnp.bfloat16),
        S((b, l, h), jnp.float32),
        S((h,), jnp.float32),
        S((b, l, 1, n), jnp.bfloat16),
        S((b, l, 1, n), jnp.bfloat16),
    )

    def loss(x, dt, A, B, C):
        y, final = ssd(
            x,
            dt,
            A,
            B,
            C,
            chunk_size=256,
            D=jnp.ones((h,)),
            return_final_state=True,
            seq_idx=jnp.zeros((b, l), jnp.int32),
            impl="pallas",
            variant=variant,
            interpret=False,
        )
        return jnp.sum(y.astype(jnp.float32)) + jnp.sum(final)

    text = lower_for(platform, jax.grad(loss, argnums=(0, 1, 2, 3, 4)), *args)
    assert ("tpu_custom_call" if platform == "tpu" else "triton") in text


def test_bad_inputs_are_named():
    inputs, _ = make_inputs(1, 8, 2, 3, 1, 4, jnp.float32)
    pos = [inputs[k] for k in ("x", "dt", "A", "B", "C")]
    with pytest.raises(ValueError, match="chunk_size a power of two >= 16, got 24"):
        ssd(*pos, chunk_size=24, impl="pallas", variant="gpu")
    with pytest.raises(
        ValueError, match="block_sizes.tile_bwd must divide chunk_size = 16, got 12"
    ):
        ssd(*pos, chunk_size=16, impl="pallas", variant="gpu", block_sizes=BlockSizes(tile_bwd=12))
    with pytest.raises(ValueError, match="block_sizes.state_rows must be a power of two, got 3"):
        ssd(*pos, chunk_size=16, impl="pallas", variant="gpu", block_sizes=BlockSizes(state_rows=3))
    for field, value in (("heads_per_block", 4), ("heads_per_program", 3)):
        with pytest.raises(
            ValueError, match=f"{field} must divide the heads per group = 2, got {value}"
        ):
            sizes = BlockSizes(**{field: value})
            ssd(*pos, chunk_size=16, impl="pallas", variant="gpu", block_sizes=sizes)
    for field in ("num_warps", "state_warps"):
        with pytest.raises(ValueError, match=f"block_sizes.{field} must be a positive int, got 0"):
            sizes = BlockSizes(**{field: 0})
            ssd(*pos, chunk_size=16, impl="pallas", variant="gpu", block_sizes=sizes)
    with pytest.raises(ValueError, match="block_sizes.mosaic_gpu must be None or a bool, got 1"):
        ssd(*pos, chunk_size=16, impl="pallas", block_sizes=BlockSizes(mosaic_gpu=1))
    with pytest.raises(ValueError, match="mosaic_gpu=True needs the gpu variant, got 'tpu'"):
        ssd(
            *pos,
            chunk_size=16,
            impl="pallas",
            variant="tpu",
            block_sizes=BlockSizes(mosaic_gpu=True),
        )
    with pytest.raises(ValueError, match="mosaic_gpu=True: .*bf16 or f16 matmul inputs"):
        ssd(*pos, chunk_size=128, impl="pallas", block_sizes=BlockSizes(mosaic_gpu=True))
    with pytest.raises(ValueError, match="variant must be one of .* got 'cuda'"):
        ssd(*pos, chunk_size=16, impl="pallas", variant="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype, mosaic_gpu",
    [(jnp.float32, None), (jnp.bfloat16, None), (jnp.bfloat16, False)],
)
def test_compiled_on_gpu(dtype, mosaic_gpu):
    """The compiled kernels at a realistic shape with packed documents: by default (bf16 on
    Hopper with custom calls kept out of CUDA graphs: Mosaic GPU chunk_state / chunk_out,
    checked in the lowered module) and with the Triton ones forced."""
    from pallas_kernels.backend import custom_calls_in_cuda_graphs
    from pallas_kernels.ssd import kernel_mgpu

    b, l, h, p, g, n = 2, 1000, 8, 64, 2, 128
    inputs, cts = make_inputs(b, l, h, p, g, n, dtype)
    seq_idx = jnp.asarray(np.repeat(np.arange(4), 250)[None].repeat(b, 0).astype(np.int32))
    kw = dict(chunk_size=256, impl="pallas", variant="gpu")
    kw["block_sizes"] = BlockSizes(mosaic_gpu=mosaic_gpu)
    ref = value_and_grads(inputs, cts, seq_idx, chunk_size=256, impl="chunked")
    got = value_and_grads(inputs, cts, seq_idx, **kw)
    assert_matches(flat(got), flat(ref), dtype)
    text = jax.jit(lambda x: ssd(x, *(inputs[k] for k in NAMES[1:5]), seq_idx=seq_idx, **kw))
    text = text.lower(inputs["x"]).as_text()
    expect_mgpu = (
        kernel_mgpu.on_hopper()
        and dtype == jnp.bfloat16
        and mosaic_gpu is None
        and not custom_calls_in_cuda_graphs()
    )
    assert ("mosaic_gpu" in text) == expect_mgpu


def test_auto_picks_pallas_on_one_gpu_only(monkeypatch):
    """impl="auto": the kernels on a GPU without a multi-device mesh (or inside shard_map),
    the pure-JAX path under an automatically partitioned mesh and off-GPU."""
    from pallas_kernels import backend

    assert not backend.auto_picks_pallas()  # CPU
    monkeypatch.setattr(backend.jax, "default_backend", lambda: "gpu")
    assert backend.auto_picks_pallas()
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh):
        assert not backend.auto_picks_pallas()
        seen = []

        def body(x):
            seen.append(backend.auto_picks_pallas())
            return x

        jax.shard_map(body, in_specs=jax.P("data"), out_specs=jax.P("data"))(jnp.zeros(8))
    assert seen == [True]
