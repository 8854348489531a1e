"""Tests of the Mosaic GPU twins of the SSD's chunk_state / chunk_out (kernel_mgpu.py).

On CPU both kernels run in Mosaic GPU's interpreter against the Triton kernels (in Pallas
interpret mode), are lowered for "cuda" (Mosaic GPU lowers on any host with jax 0.10), bad
inputs raise, and the choice between them and Triton is pinned. `ssd` end to end with them
(values and gradients) is in test_ssd_pallas.py. The gpu-marked test runs them compiled.
"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.backend import lower_for
from pallas_kernels.ssd import kernel as triton
from pallas_kernels.ssd import kernel_mgpu as mgpu
from pallas_kernels.ssd import pallas, state_passing
from pallas_kernels.ssd.tiling import BlockSizes, resolve_block_sizes

# Max abs error relative to the largest Triton magnitude. States: both sides multiply the same
# bf16 values and sum in fp32. Outputs: rounded to bf16 once on each side, and the Mosaic GPU
# kernel takes C_s . B_t in fp32 where the Triton kernel reads it rounded to bf16.
STATE_TOL = 1e-5
OUT_TOL = 2e-2


def assert_scaled_close(got, want, tol, name):
    """max |got - want| <= tol * max |want| (fp32 copies)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= tol, f"{name}: error {err:.2e} of the scale > {tol}"


def prepared(b, l, h, g, n, chunk, seq_idx=None, seed=0, dtype=jnp.bfloat16, p=64):
    """pallas.Prepared of random inputs like a Mamba-2 layer's (softplus'd dt, negative A)."""
    rng = np.random.default_rng(seed)
    normal = lambda *s: rng.standard_normal(s, np.float32)  # noqa: E731
    x = jnp.asarray(normal(b, l, h, p), dtype)
    dt = jnp.asarray(np.log1p(np.exp(normal(b, l, h) - 3.0)))
    A = -jnp.asarray(np.exp(rng.uniform(0.0, 2.0, h)), jnp.float32)
    B, C = (jnp.asarray(normal(b, l, g, n), dtype) for _ in range(2))
    D = jnp.asarray(normal(h))
    sizes = resolve_block_sizes("gpu", chunk, h // g)
    return pallas.Prepared(x, dt, A, B, C, D, seq_idx, chunk, "gpu", sizes)


def states_both(prep, interpret):
    """(Triton, Mosaic GPU) chunk states of prep."""
    w = prep.w_state * prep.dt
    return (
        triton.chunk_states(prep, prep.x, w, prep.B, interpret=interpret),
        mgpu.chunk_states_mgpu(prep, prep.x, w, prep.B, interpret=interpret),
    )


def test_chunk_states_interpreted():
    """Mosaic GPU interpreter vs Pallas-Triton interpreter: 2 chunks, 2 heads per group."""
    want, got = states_both(prepared(1, 256, 2, 1, 64, 128), interpret=True)
    assert got.dtype == want.dtype
    assert_scaled_close(got, want, STATE_TOL, "states")


def test_chunk_outputs_interpreted():
    """Mosaic GPU interpreter vs Pallas-Triton interpreter: 2 chunks of 256 (two programs of
    128 target rows each), 2 groups, 4 heads per group (the heads loop reuses both buffer
    slots), a document boundary inside the second chunk."""
    seq_idx = jnp.asarray(np.repeat([0, 1], [300, 212])[None].astype(np.int32))
    prep = prepared(1, 512, 8, 2, 64, 256, seq_idx=seq_idx)
    S = triton.chunk_states(prep, prep.x, prep.w_state * prep.dt, prep.B, interpret=True)
    h_in, _ = state_passing.pass_states(prep, S, pallas.pad_state(prep, None), True)
    want = triton.chunk_outputs(prep, h_in, interpret=True)
    got = mgpu.chunk_outputs_mgpu(prep, h_in, interpret=True)
    assert got.dtype == want.dtype
    assert_scaled_close(got, want, OUT_TOL, "y")


@pytest.mark.parametrize(
    "b, c, h, g, set_to, want",
    [
        (1, 128, 24, 1, None, 8),  # one 32K row of Mamba-2 130M: 384 programs of 8 heads
        (1, 64, 24, 1, None, 4),  # its 16K shard on seq=2: 192 of 8 would leave the GPU idle
        (8, 8, 24, 1, None, 4),  # 8 x 2048
        (1, 64, 24, 1, 2, 2),  # BlockSizes.heads_per_program decides when given
        (1, 64, 6, 1, None, 3),  # at most 4 among the divisors of 6
        (1, 512, 80, 8, None, 5),  # 10 heads a group: its largest divisor up to 8
    ],
)
def test_heads_per_program(b, c, h, g, set_to, want):
    """Heads a Mosaic GPU program: 8 (or the largest divisor up to 8 of the heads a group),
    unless that leaves fewer than MIN_PROGRAMS programs; then the largest divisor up to 4."""
    sizes = resolve_block_sizes("gpu", 256, h // g, BlockSizes(heads_per_program=set_to))
    prep = types.SimpleNamespace(shape=(b, c * 256, h, 64, g, 128), c=c, sizes=sizes)
    assert mgpu._heads_per_program(prep) == want


def test_interpreter_refuses_too_few_threads(monkeypatch):
    """With fewer XLA CPU threads than warpgroups + 1 the interpreter would hang: it refuses."""
    monkeypatch.setenv("NPROC", "3")
    prep = prepared(1, 128, 2, 1, 64, 128)
    with pytest.raises(RuntimeError, match="3 threads .* NPROC=4"):
        mgpu.chunk_outputs_mgpu(prep, jnp.zeros((1, 1, 2, 64, 64), jnp.bfloat16), interpret=True)


def test_choice_of_kernels(monkeypatch):
    """None: Mosaic GPU only compiled on Hopper (never on this CPU) with custom calls kept out
    of XLA's CUDA graphs; True forces it and names what does not suit it; False refuses it."""
    prep = prepared(1, 128, 2, 1, 64, 128)
    assert not mgpu.on_hopper()
    assert not mgpu.use_mosaic_gpu(prep, None, interpret=None)
    monkeypatch.setattr(mgpu, "on_hopper", lambda: True)
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=-CUSTOM_CALL")
    assert mgpu.use_mosaic_gpu(prep, None, interpret=False)
    assert not mgpu.use_mosaic_gpu(prep, None, interpret=True)
    fp32 = prepared(1, 128, 2, 1, 64, 128, dtype=jnp.float32)
    assert not mgpu.use_mosaic_gpu(fp32, None, interpret=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert not mgpu.use_mosaic_gpu(prep, None, interpret=False)  # recorded into CUDA graphs
    assert mgpu.use_mosaic_gpu(prep, True, interpret=True)
    assert not mgpu.use_mosaic_gpu(prep, False, interpret=None)
    with pytest.raises(ValueError, match="mosaic_gpu=True: .*bf16 or f16 .* got float32"):
        mgpu.use_mosaic_gpu(prepared(1, 128, 2, 1, 64, 128, dtype=jnp.float32), True, None)


def test_lowers_for_cuda():
    """Both kernels lower to Mosaic GPU at an issue-like shape (no GPU needed with jax 0.10)."""
    S = jax.ShapeDtypeStruct
    b, l, h, p, n = 2, 1024, 8, 64, 128
    args = (
        S((b, l, h, p), jnp.bfloat16),
        S((b, l, h), jnp.float32),
        S((h,), jnp.float32),
        S((b, l, 1, n), jnp.bfloat16),
        S((b, l, 1, n), jnp.bfloat16),
        S((h,), jnp.float32),
    )
    sizes = resolve_block_sizes("gpu", 256, h)

    def forward(x, dt, A, B, C, D):
        prep = pallas.Prepared(x, dt, A, B, C, D, None, 256, "gpu", sizes)
        S_ = mgpu.chunk_states_mgpu(prep, prep.x, prep.w_state * prep.dt, prep.B, interpret=False)
        h_in, _ = state_passing.pass_states(prep, S_, pallas.pad_state(prep, None), False)
        return mgpu.chunk_outputs_mgpu(prep, h_in, interpret=False)

    try:
        text = lower_for("cuda", forward, *args)
    except RuntimeError as err:  # jax >= 0.11 wants an abstract GPU device on a CPU host
        if "No supported GPU devices" not in str(err):
            raise
        pytest.skip(f"Mosaic GPU lowering needs a GPU device here: {err}")
    assert "mosaic_gpu" in text


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(dtype=jnp.float32), "bf16 or f16"),
        (dict(p=32), "multiples of 64"),
        (dict(chunk=64), "multiple of 128"),
    ],
)
def test_rejects_unsupported(kwargs, match):
    """fp32 (tf32 wgmma), head dims off the 64-row tile, chunks off two warpgroups: ValueError."""
    args = dict(b=1, l=128, h=2, g=1, n=64, chunk=128) | kwargs
    prep = prepared(**args)
    with pytest.raises(ValueError, match=match):
        mgpu.chunk_states_mgpu(prep, prep.x, prep.w_state * prep.dt, prep.B)


@pytest.mark.gpu
@pytest.mark.parametrize("g, documents", [(1, False), (2, True)])
def test_compiled_matches_triton(g, documents):
    """Compiled on a Hopper GPU: both kernels against the Triton ones, 4 chunks of 256, packed
    documents (seq_idx) in one case."""
    b, l, h, n = 2, 1000, 8, 128
    seq_idx = None
    if documents:
        seq_idx = jnp.asarray(np.repeat(np.arange(4), 250)[None].repeat(b, 0).astype(np.int32))
    prep = prepared(b, l, h, g, n, 256, seq_idx=seq_idx)
    want, got = states_both(prep, interpret=None)
    assert_scaled_close(got, want, STATE_TOL, "states")
    h_in, _ = state_passing.pass_states(prep, want, pallas.pad_state(prep, None))
    want_y = triton.chunk_outputs(prep, h_in)
    assert_scaled_close(mgpu.chunk_outputs_mgpu(prep, h_in), want_y, OUT_TOL, "y")
