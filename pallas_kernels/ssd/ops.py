"""Public Mamba-2 SSD: input checks plus the `impl=` switch."""

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from .. import backend
from ..checks import check_float, check_shape
from . import pallas
from .chunked import ssd_chunked
from .reference import ssd_reference, ssd_sequential
from .tiling import resolve_block_sizes

# The states entering each chunk (and a shard's decay), which only the forward kernels compute:
# a remat policy that saves them by this name (with the SSD's inputs and y) reruns no SSD forward.
CHUNK_STATES = "ssd_chunk_states"

IMPLS = ("auto", "chunked", "pallas", "reference", "sequential")


def _validate(x, dt, A, B, C, D, initial_state, seq_idx, chunk_size, impl):
    """Check shapes, dtypes and static arguments; return (b, l, h, p, g, n)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if x.ndim != 4:
        raise ValueError(f"x must have shape (b, l, h, p), got {x.shape}")
    b, l, h, p = x.shape
    check_shape("dt", dt, (b, l, h), "(b, l, h)")
    check_shape("A", A, (h,), "(h,)")
    if B.ndim != 4 or B.shape[:2] != (b, l):
        raise ValueError(f"B must have shape (b, l, g, n) with (b, l) = {(b, l)}, got {B.shape}")
    g, n = B.shape[2:]
    check_shape("C", C, (b, l, g, n), "(b, l, g, n)")
    if g == 0 or h % g != 0:
        raise ValueError(f"heads h = {h} must be a multiple of groups g = {g}")
    for name, arr in (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C)):
        check_float(name, arr)
    for name, arr, shape, desc in (
        ("D", D, (h,), "(h,)"),
        ("initial_state", initial_state, (b, h, p, n), "(b, h, p, n)"),
    ):
        if arr is not None:
            check_shape(name, arr, shape, desc)
            check_float(name, arr)
    if seq_idx is not None:
        check_shape("seq_idx", seq_idx, (b, l), "(b, l)")
        if not jnp.issubdtype(seq_idx.dtype, jnp.integer):
            raise ValueError(f"seq_idx must have an integer dtype, got {seq_idx.dtype}")
    return b, l, h, p, g, n


def _check_pallas(x, dt, A, B, C, D, initial_state, chunk_size, variant):
    """What the Pallas kernels need beyond the op's contract."""
    backend.check_variant(variant)
    for name, arr in (
        ("x", x),
        ("dt", dt),
        ("A", A),
        ("B", B),
        ("C", C),
        ("D", D),
        ("initial_state", initial_state),
    ):
        if arr is not None and arr.dtype == jnp.float64:
            raise ValueError(f"impl='pallas' computes in fp32; {name} is float64")
    if variant == "gpu" and (chunk_size < 16 or chunk_size & (chunk_size - 1)):
        raise ValueError(
            f"impl='pallas' on the gpu variant needs chunk_size a power of two >= 16, "
            f"got {chunk_size}"
        )


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11))
def _ssd_pallas(x, dt, A, B, C, D, initial_state, seq_idx, chunk_size, variant, sizes, interpret):
    """(y, final state) by the Pallas kernels, differentiable through the hand-written backward."""
    outputs, _ = _ssd_pallas_fwd(
        x, dt, A, B, C, D, initial_state, seq_idx, chunk_size, variant, sizes, interpret
    )
    return outputs


def _ssd_pallas_fwd(
    x, dt, A, B, C, D, initial_state, seq_idx, chunk_size, variant, sizes, interpret
):
    y, final, h_in = pallas.forward(
        x,
        dt,
        A,
        B,
        C,
        D,
        initial_state,
        seq_idx,
        chunk_size=chunk_size,
        variant=variant,
        sizes=sizes,
        interpret=interpret,
    )
    h_in = checkpoint_name(h_in, CHUNK_STATES)
    return (y, final), (x, dt, A, B, C, D, initial_state, seq_idx, h_in)


def _ssd_pallas_bwd(chunk_size, variant, sizes, interpret, residuals, cotangents):
    x, dt, A, B, C, D, initial_state, seq_idx, h_in = residuals
    dy, dfinal = cotangents
    dx, ddt, dA, dB, dC, dD, dh0 = pallas.backward(
        x,
        dt,
        A,
        B,
        C,
        D,
        initial_state,
        seq_idx,
        h_in,
        dy,
        dfinal,
        chunk_size=chunk_size,
        variant=variant,
        sizes=sizes,
        interpret=interpret,
    )
    cast = lambda grad, primal: None if primal is None else grad.astype(primal.dtype)  # noqa: E731
    return (
        cast(dx, x),
        cast(ddt, dt),
        cast(dA, A),
        cast(dB, B),
        cast(dC, C),
        cast(dD, D),
        cast(dh0, initial_state),
        None,
    )


_ssd_pallas.defvjp(_ssd_pallas_fwd, _ssd_pallas_bwd)


def resolve_impl(impl, x, dt, A, B, C, D, initial_state, chunk_size, variant) -> str:
    """The implementation `ssd` runs: impl itself, or for "auto" "pallas" where
    `backend.auto_picks_pallas()` and the kernels take these arguments, else "chunked"."""
    if impl != "auto":
        return impl
    if backend.auto_picks_pallas() and variant in (None, "gpu"):
        try:
            _check_pallas(x, dt, A, B, C, D, initial_state, chunk_size, "gpu")
            return "pallas"
        except ValueError:  # e.g. a chunk size Triton cannot tile: the portable path
            pass
    return "chunked"


@functools.partial(
    jax.jit,
    static_argnames=(
        "chunk_size",
        "return_final_state",
        "impl",
        "variant",
        "interpret",
        "block_sizes",
    ),
)
def ssd(
    x,
    dt,
    A,
    B,
    C,
    *,
    chunk_size,
    D=None,
    initial_state=None,
    return_final_state=False,
    seq_idx=None,
    impl="auto",
    variant=None,
    interpret=None,
    block_sizes=None,
):
    """Mamba-2 SSD: y, or (y, final_state) if return_final_state.

    Shapes: x (b, l, h, p); dt (b, l, h) positive (softplus'd and clamped by the caller);
    A (h,) negative; B, C (b, l, g, n), head hh reads group hh // (h // g); D (h,) skip on the
    unscaled x; initial_state (b, h, p, n); seq_idx (b, l) int32, nondecreasing.

        h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,   y_t = h_t C_t + D x_t.

    seq_idx marks packed documents: y equals running ssd separately on each maximal run of
    equal seq_idx in a row, with initial_state applied only to the row's first run; the final
    state is the state at the end of the row's last run (started from zero at that run's
    start unless it is also the first run). No state crosses a change of seq_idx.
    Computes in fp32 (fp64 inputs stay fp64); y in x.dtype, final_state (b, h, p, n) in the
    compute dtype. impl: "auto" ("pallas" where `backend.auto_picks_pallas()` and the kernels
    take these arguments, else "chunked"), "chunked" (Mamba-2 chunked algorithm, `chunk_size` a
    positive int),
    "pallas" (the same algorithm as Pallas kernels with a hand-written backward; fp32 compute,
    matmul inputs in the inputs' dtype), "reference" (quadratic form, O(l^2)) or "sequential"
    (step-by-step recurrence); the last two validate but ignore chunk_size.
    Pallas only: variant "gpu" (Triton) or "tpu" (Mosaic), None = the backend's; interpret
    None = compiled on the variant's hardware, interpreted elsewhere; block_sizes
    (`BlockSizes`: rows per tile, heads per backward program, warps) tunes the kernels.
    """
    _validate(x, dt, A, B, C, D, initial_state, seq_idx, chunk_size, impl)
    impl = resolve_impl(impl, x, dt, A, B, C, D, initial_state, chunk_size, variant)
    kwargs = dict(
        D=D, initial_state=initial_state, return_final_state=return_final_state, seq_idx=seq_idx
    )
    if impl == "reference":
        return ssd_reference(x, dt, A, B, C, **kwargs)
    if impl == "sequential":
        return ssd_sequential(x, dt, A, B, C, **kwargs)
    if impl == "pallas":
        variant = variant or backend.default_variant()
        _check_pallas(x, dt, A, B, C, D, initial_state, chunk_size, variant)
        sizes = resolve_block_sizes(variant, chunk_size, x.shape[2] // B.shape[2], block_sizes)
        y, final = _ssd_pallas(
            x, dt, A, B, C, D, initial_state, seq_idx, chunk_size, variant, sizes, interpret
        )
        return (y, final) if return_final_state else y
    return ssd_chunked(x, dt, A, B, C, chunk_size=chunk_size, **kwargs)


# ----------------------------------------------------------------------------- one sequence shard


def ssd_shard(
    x,
    dt,
    A,
    B,
    C,
    *,
    chunk_size,
    exchange,
    keep_in,
    D=None,
    initial_state=None,
    seq_idx=None,
    variant=None,
    interpret=None,
    block_sizes=None,
):
    """(y, state after the last shard): the Pallas SSD of one shard of a sequence split over
    devices, exact to `ssd` over the whole (Mamba-2 paper section 8.2), for use inside a map over
    the shards.

    The chunk states are computed once; this shard's state from a zero start is summed from them
    and `exchange` (a pair of functions) turns it into the state entering the shard:

        forward(decay, final, initial) -> (entering, state after the last shard)
        grads(decay, d_entering, d_last) -> (d final, d initial)

    where decay (b, h, 1, 1) is the shard's total decay and forward composes the shards' maps
    h -> decay h + final onto `initial`; grads is its transpose (d_entering: this shard's gradient
    of its entering state through its own outputs; d_last None where that gradient is a symbolic
    zero; d initial: nonzero on the first shard only).
    The kernels then run from the entering state, and the backward runs them once with this
    shard's final-state gradient. keep_in (b,) is 1 where the shard's first position continues
    the document the previous shard ended in, else 0 (no state enters). Arguments otherwise as
    `ssd` with impl="pallas"."""
    _validate(x, dt, A, B, C, D, initial_state, seq_idx, chunk_size, "pallas")
    variant = variant or backend.default_variant()
    _check_pallas(x, dt, A, B, C, D, initial_state, chunk_size, variant)
    check_shape("keep_in", keep_in, (x.shape[0],), "(b,)")
    exchange = tuple(exchange)
    if len(exchange) != 2 or not all(callable(f) for f in exchange):
        raise ValueError(f"exchange must be a pair of functions (forward, grads), got {exchange!r}")
    sizes = resolve_block_sizes(variant, chunk_size, x.shape[2] // B.shape[2], block_sizes)
    arrays = (x, dt, A, B, C, D, initial_state, seq_idx, keep_in)
    return _ssd_pallas_shard(arrays, (chunk_size, variant, sizes, interpret, exchange))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _ssd_pallas_shard(arrays, statics):
    return _ssd_pallas_shard_fwd(arrays, statics)[0]


def _ssd_pallas_shard_fwd(arrays, statics):
    # symbolic_zeros: the VJP passes each array as a CustomVJPPrimal (its .value is the array).
    is_primal = lambda a: isinstance(a, CustomVJPPrimal)  # noqa: E731
    arrays = jax.tree.map(lambda a: getattr(a, "value", a), arrays, is_leaf=is_primal)
    x, dt, A, B, C, D, initial_state, seq_idx, keep_in = arrays
    chunk_size, variant, sizes, interpret, (forward, _) = statics
    kw = dict(chunk_size=chunk_size, variant=variant, sizes=sizes, interpret=interpret)
    prep, S = pallas.forward_states(x, dt, A, B, C, D, seq_idx, **kw)
    keep_b1 = keep_in.astype(jnp.float32)[:, None, None, None]
    # The whole shard's decay: zero across a change of document, or where none enters.
    decay = jnp.prod(prep.decay, axis=-1)[..., None, None] * keep_b1
    # The barrier keeps the sum over chunks a reduction of its own: fused into the exchange's
    # concatenate, XLA:GPU emitted it as a slow loop over the chunk states (2.4 ms a step of
    # HAX 64K on seq=2, H200).
    final = jax.lax.optimization_barrier(pallas.zero_start_final(prep, S))
    entering, last = forward(decay, final, initial_state)
    y, _, h_in = pallas.forward_from_states(prep, S, entering * keep_b1, interpret)
    decay, h_in = checkpoint_name((decay, h_in), CHUNK_STATES)
    return (y, last.astype(jnp.float32)), (arrays, decay, h_in)


def _ssd_pallas_shard_bwd(statics, residuals, cotangents):
    arrays, decay, h_in = residuals
    x, dt, A, B, C, D, initial_state, seq_idx, keep_in = arrays
    chunk_size, variant, sizes, interpret, (_, grads) = statics
    kw = dict(chunk_size=chunk_size, variant=variant, sizes=sizes, interpret=interpret)
    dy, d_last = cotangents
    if isinstance(dy, SymbolicZero):
        dy = jnp.zeros(dy.shape, dy.dtype)
    prep, dy_l, dS = pallas.backward_states(x, dt, A, B, C, D, seq_idx, dy, **kw)
    keep_b1 = keep_in.astype(jnp.float32)[:, None, None, None]
    d_entering = pallas.initial_state_grad_from_outputs(prep, dS) * keep_b1
    # Training never reads the state after the last shard: its gradient is a symbolic zero,
    # and the exchange's transpose then sends none.
    d_last = None if isinstance(d_last, SymbolicZero) else d_last
    d_final, d_initial = grads(decay, d_entering, d_last)
    dx, ddt, dA, dB, dC, dD, _ = pallas.backward_from_states(
        prep, dy_l, dS, d_final, h_in, interpret
    )
    cast = lambda grad, primal: None if primal is None else grad.astype(primal.dtype)  # noqa: E731
    primals = (x, dt, A, B, C, D, initial_state)
    grads_out = tuple(map(cast, (dx, ddt, dA, dB, dC, dD, d_initial), primals))
    return (grads_out + (None, None),)


_ssd_pallas_shard.defvjp(_ssd_pallas_shard_fwd, _ssd_pallas_shard_bwd, symbolic_zeros=True)
