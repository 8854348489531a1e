"""The Mamba-2 decode step's SSM update as a Pallas kernel on a bounded grid (ssd/step_pallas.py)
against the plain recurrence (reference.ssd_sequential, one position from an initial state):
interpreted on CPU for grids that divide the (row, head) pairs, do not, and outnumber them;
cross-lowered for CUDA at the HAX 130M decode shapes; compiled on a GPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_checks import COMPILED, assert_close

from pallas_kernels.backend import lower_for
from pallas_kernels.ssd.reference import ssd_sequential
from pallas_kernels.ssd.step_pallas import ssm_step_pallas, unsupported

# fp32 compute on both sides from the same (possibly bf16) inputs.
TOL = dict(atol=1e-5, rtol=1e-5)


def _inputs(b, h, p, g, n, dtype, seed=0):
    """Random step inputs: x, B, C in dtype; the state, dt (positive), A (negative), D fp32."""
    rng = np.random.default_rng(seed)
    normal = lambda *s: rng.standard_normal(s, np.float32)  # noqa: E731
    return dict(
        h=jnp.asarray(normal(b, h, p, n)),
        x=jnp.asarray(normal(b, h, p), dtype),
        dt=jnp.asarray(np.log1p(np.exp(normal(b, h) - 1.0))),
        A=jnp.asarray(-np.exp(normal(h))),
        B=jnp.asarray(normal(b, g, n), dtype),
        C=jnp.asarray(normal(b, g, n), dtype),
        D=jnp.asarray(normal(h)),
    )


def _recurrence(h, x, dt, A, B, C, D):
    """(y, h') of one position of the plain recurrence, in fp32 from the same values."""
    f32 = lambda a: a.astype(jnp.float32)[:, None]  # noqa: E731  # a length-1 sequence
    y, final = ssd_sequential(
        f32(x), f32(dt), A, f32(B), f32(C), D=D, initial_state=h, return_final_state=True
    )
    return y[:, 0], final


def _check(inputs, programs, interpret=None):
    got = jax.jit(functools.partial(ssm_step_pallas, programs=programs, interpret=interpret))(
        **inputs
    )
    want = _recurrence(**inputs)
    for name, a, d in zip(("y", "state"), got, want, strict=True):
        assert a.dtype == jnp.float32, name
        assert_close(a, d, TOL, name)


@pytest.mark.parametrize("programs", [1, 5, 12, 100])  # 12 pairs: fewer, a divisor, more
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_equals_the_recurrence(programs, dtype):
    """3 rows x 4 heads in 2 groups, p 8, n 16."""
    _check(_inputs(3, 4, 8, 2, 16, dtype), programs)


def test_kernel_lowers_for_cuda_at_the_hax_130m_decode_shapes():
    """Cross-lowered (no GPU needed): batch 64, 24 heads of 64, one group, n 128, bf16 x / B / C,
    64 programs."""
    z = lambda *s, dtype=jnp.float32: jnp.zeros(s, dtype)  # noqa: E731
    bf = jnp.bfloat16
    step = functools.partial(ssm_step_pallas, programs=64, interpret=False)
    text = lower_for(
        "cuda", step, z(64, 24, 64, 128), z(64, 24, 64, dtype=bf), z(64, 24), z(24),
        z(64, 1, 128, dtype=bf), z(64, 1, 128, dtype=bf), z(24),
    )  # fmt: skip
    assert "triton_kernel_call" in text or "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("p, n, bad", [(48, 128, "head dim p = 48"), (64, 96, "state dim n = 96")])
def test_unsupported_names_the_dimension(p, n, bad):
    assert unsupported(64, 128) is None
    assert bad in unsupported(p, n)


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [64, 1536])
def test_compiled_on_gpu(programs, monkeypatch):
    """The HAX 130M decode shapes at batch 64, bf16 inputs: on 64 programs and on one a pair."""
    monkeypatch.setitem(COMPILED, "on", True)
    _check(_inputs(64, 24, 64, 1, 128, jnp.bfloat16, seed=1), programs, interpret=False)
