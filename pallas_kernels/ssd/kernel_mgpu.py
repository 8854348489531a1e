"""The SSD's two heavy chunk kernels, chunk_state and chunk_out, for Mosaic GPU (Hopper).

kernel.py writes them for Pallas Triton; these are their Mosaic GPU ("plgpu") twins. They take
the same `Prepared` inputs (the "gpu" layout) and return what `chunk_states` / `chunk_outputs`
return, so `pallas.forward` / `pallas.backward` take them instead on an sm_90 GPU when the inputs
suit them and XLA runs custom calls outside its CUDA graphs (`use_mosaic_gpu`): chunk_out
measured 0.66-0.78x the Triton kernel's time on an H100, chunk_state level (BENCHMARKS.md,
bench/ssd_mosaic_gpu.py).

What Mosaic GPU adds over Triton here: warpgroup matmuls (wgmma) reading swizzled shared
memory, TMA copies issued by a dedicated memory warpgroup, and programs that loop over a block
of heads, so the operands shared by the heads of a group (B, and C for chunk_out) are loaded
once per program instead of once per head, while the next head's x and state are prefetched
(two buffers) during the current head's matmuls.

    chunk_state: per (b, c, block of heads): S_h (p, n) = (w_h x_h)^T B over the chunk. One
        compute warpgroup scales x by w in place (shared memory), then one wgmma with the
        transposed x as its left operand.
    chunk_out: per (b, c, block of heads, 128 target rows): two compute warpgroups of 64 rows.
        y_s = sum_{t<=s} (C_s.B_t) L[s, t] dt_t x_t + w_out[s] C_s H^T + D x_s, with C_s.B_t
        computed in the kernel by wgmma (fp32; kernel.py reads it rounded to bf16 from XLA)
        and the causal / same-document mask and decay applied in registers as in kernel.py.

Only 16-bit matmul inputs: fp32 wgmma means tf32 (10-bit mantissa, far outside the fp32
tolerance the Triton kernels meet) and requires both operands contiguous along the contracted
axis, which the sequence-contracting matmuls here are not; fp32 raises ValueError.
Lowering uses the Lane semantics (explicit tiling and swizzle transforms), set explicitly
because the default changed between jax 0.10 (Lane) and 0.11 (Warpgroup). Letters as in
kernel.py.

On a CPU they run in Mosaic GPU's interpreter, which gives each warpgroup a thread whose
barrier waits block one of the XLA CPU client's threads; with fewer of those than warpgroups
plus one (chunk_out has 3 warpgroups; measured: inside a jitted caller, 3 threads hang, 4 run)
a kernel waits forever, so the interpreted call refuses to start then (XLA sizes that pool by
the CPUs, or by NPROC if set before jax starts; tests/conftest.py sets it).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..backend import custom_calls_in_cuda_graphs, mosaic_gpu_interpret_params
from .kernel import F32

ROWS = 64  # rows of one wgmma tile (one warpgroup); also the source tile of chunk_out
SWIZZLE = 128  # bytes: the widest swizzle, so rows of >= 64 bf16 elements tile as (8, 64)
_MM_DTYPES = (jnp.bfloat16, jnp.float16)
_SMEM_BYTES = 227 * 1024  # an H100's shared memory per block (opt-in maximum)


def _smem(shape, dtype):
    """A shared-memory buffer laid out for wgmma and TMA: (8, swizzle) tiles of its last two
    dims, swizzled (the last dim must span >= 128 bytes)."""
    elems = SWIZZLE // jnp.dtype(dtype).itemsize
    transforms = (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(SWIZZLE))
    return plgpu.SMEM(shape, dtype, transforms=transforms)


def _nbytes(shape, dtype):
    """Bytes of an array of this shape and dtype."""
    size = jnp.dtype(dtype).itemsize
    for d in shape:
        size *= d
    return size


class _Ops:
    """Register-level operations of the kernels, compiled or interpreted.

    Compiled: loads and iotas in wgmma register layouts, matmuls as wgmma reading shared
    memory (the left operand may also be registers), transposes as transposed views of shared
    memory. Interpreted (Mosaic GPU's interpreter on CPU): plain reads and jnp matmuls, since
    the interpreters of jax 0.10 / 0.11 run neither wgmma on transposed operands (0.10) nor
    with the left operand in registers (both), nor plgpu.load (0.10); layouts mean nothing
    there. Everything else (grid, TMA copies, barriers, buffers, masks) runs as compiled."""

    def __init__(self, interpreted):
        self.interpreted = interpreted

    def load(self, ref, layout):
        """ref's whole contents in `layout` (0.11 deprecates the index argument 0.10 needs)."""
        if self.interpreted:
            return ref[...]
        if _load_takes_index():
            return plgpu.load(ref, (), layout=layout)
        return plgpu.load(ref, layout=layout)

    def iota(self, shape, dimension):
        """int32 positions along `dimension`, in the wgmma accumulator's layout."""
        if self.interpreted:
            return lax.broadcasted_iota(jnp.int32, shape, dimension)
        return plgpu.broadcasted_iota(jnp.int32, shape, dimension, layout=plgpu.Layout.WGMMA)

    def zeros(self, shape):
        """An fp32 accumulator of zeros."""
        zeros = jnp.zeros(shape, F32)
        return zeros if self.interpreted else plgpu.layout_cast(zeros, plgpu.Layout.WGMMA)

    def _operand(self, ref, transpose):
        """A shared-memory operand (or registers if not a ref), optionally transposed."""
        if self.interpreted:
            value = ref if isinstance(ref, jax.Array) else ref[...]
            return value.T if transpose else value
        return ref.transpose((1, 0)) if transpose else ref

    def matmul(self, a, b, *, trans_a=False, trans_b=False):
        """a @ b (fp32) of shared-memory operands, each optionally transposed."""
        a, b = self._operand(a, trans_a), self._operand(b, trans_b)
        if self.interpreted:
            return jnp.dot(a, b, preferred_element_type=F32)

        def run(acc_ref):
            plgpu.wgmma(acc_ref, a, b)
            return acc_ref[...]

        return pl.run_scoped(run, plgpu.ACC((a.shape[0], b.shape[1]), F32))

    def matmul_acc(self, acc, a, b):
        """acc + a @ b with a (16-bit) in registers and b in shared memory."""
        if self.interpreted:
            return acc + jnp.dot(a, b[...], preferred_element_type=F32)

        def run(acc_ref):
            plgpu.wgmma(acc_ref, a, b)

        return pl.run_state(run)(plgpu.ACC.init(acc))


@functools.cache
def _load_takes_index():
    """Whether plgpu.load requires its `idx` argument (jax 0.10; 0.11 deprecates it)."""
    import inspect

    idx = inspect.signature(plgpu.load).parameters.get("idx")
    return idx is not None and idx.default is inspect.Parameter.empty


# Heads a program: 8 measured fastest from 384 programs of chunk_state (b c h / 8: one 32K
# row of Mamba-2 130M's 24 heads, H200); below that 4 (a 16K shard of that row on seq=2, or
# 8 x 2048: chunk_out 108 against 118 us, chunk_state 70 against 78); 2 and 1 slower than 4.
MOST_HEADS_PER_PROGRAM = 8
MIN_PROGRAMS = 384


def _heads_per_program(prep):
    """Heads (of one group) looped over inside one program, so that the group's B / C load once
    for all of them: BlockSizes.heads_per_program, else the largest divisor of the heads per
    group up to 8, or up to 4 where 8 leaves fewer than MIN_PROGRAMS programs to fill the GPU."""
    if prep.sizes.heads_per_program is not None:
        return prep.sizes.heads_per_program
    b, _, h, _, g, _ = prep.shape
    r = h // g
    divisors = [d for d in range(1, min(r, MOST_HEADS_PER_PROGRAM) + 1) if r % d == 0]
    if b * prep.c * (h // max(divisors)) >= MIN_PROGRAMS:
        return max(divisors)
    return max(d for d in divisors if d <= MOST_HEADS_PER_PROGRAM // 2)


def unsuitable(prep):
    """Why these kernels cannot take prep (a sentence), or None: they need the gpu layout,
    16-bit matmul inputs, p and n multiples of 64 and a chunk a multiple of 128 (chunk_out:
    two 64-row warpgroups)."""
    if not prep.layout.gpu:
        return "Mosaic GPU kernels take the 'gpu' variant's layout"
    if jnp.dtype(prep.mm_dtype) not in map(jnp.dtype, _MM_DTYPES):
        return (
            f"Mosaic GPU wgmma needs bf16 or f16 matmul inputs, got {prep.mm_dtype} "
            "(fp32 would run as tf32 and needs operands contiguous along the contracted axis)"
        )
    p, n, k = prep.p_pad, prep.n_pad, prep.k
    if p % ROWS or n % ROWS:
        return f"headdim {p=} and d_state {n=} must be multiples of {ROWS}"
    if k % (2 * ROWS):
        return f"chunk_size {k=} must be a multiple of {2 * ROWS}"
    return None


def _check(prep, what):
    """ValueError naming what is wrong unless prep suits these kernels."""
    reason = unsuitable(prep)
    if reason is not None:
        raise ValueError(f"{what}: {reason}")


def on_hopper():
    """Whether the default backend is a GPU of compute capability 9.x (wgmma: sm_90a)."""
    if jax.default_backend() != "gpu":
        return False
    capability = getattr(jax.devices()[0], "compute_capability", "")
    return str(capability).startswith("9.")


def use_mosaic_gpu(prep, choice, interpret):
    """Whether kernel.py takes these kernels for chunk_state / chunk_out: `choice` (the
    BlockSizes.mosaic_gpu knob) True forces them (ValueError if prep does not suit them), False
    refuses them, None takes them when compiled on Hopper, prep suits them and XLA keeps custom
    calls out of its CUDA graphs: recorded into them, the kernels' host time outweighed their
    gain in the 130M training steps on an H100 (BENCHMARKS.md; train.py sets the flag)."""
    if choice is not None:
        if choice:
            _check(prep, "block_sizes.mosaic_gpu=True")
        return bool(choice)
    if interpret or not on_hopper() or unsuitable(prep) is not None:
        return False
    return not custom_calls_in_cuda_graphs()


def _compiler_params():
    """Lane semantics (explicit transforms), exp by ex2.approx like Triton's."""
    return plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane)


# ---------------------------------------------------------------- chunk_state


def chunk_states_mgpu(prep, x, w_bhck, B, *, interpret=None):
    """S (b, c, h, p', n') fp32: per chunk sum_t w[t] x[t]^T B[t]; x (b, l', h, p') and B
    (b, l', g, n') in the matmul dtype, w (b, h, c, k) fp32. Same contract as
    kernel.chunk_states."""
    _check(prep, "chunk_states_mgpu")
    b, _, h, _, g, _ = prep.shape
    p, n, c, k = prep.p_pad, prep.n_pad, prep.c, prep.k
    r = h // g
    hb = _heads_per_program(prep)
    dtype = x.dtype
    if B.dtype != dtype:
        raise ValueError(f"chunk_states_mgpu: x and B dtypes differ: {dtype} vs {B.dtype}")
    slots = 2  # x / w buffers: the next head loads while this one computes
    params = mosaic_gpu_interpret_params(interpret, num_threads=2)
    ops = _Ops(params is not None)
    smem = [
        _smem((k, n), dtype),  # B of the chunk's group
        _smem((slots, k, p), dtype),  # x, scaled by w in place
        plgpu.SMEM((slots, k), F32),  # w
        _smem((slots, p, n), F32),  # S staged for the TMA store
    ]
    _check_smem("chunk_states_mgpu", smem)

    def chunk_state(
        x_ref, w_ref, b_ref, s_ref, b_smem, x_smem, w_smem, s_smem, b_ready, head_ready, head_free
    ):
        # inputs: x_ref (b, l', h, p), w_ref (b, h, c, k), b_ref (b, l', g, n) in GMEM
        # outputs: s_ref (b, c, h, p, n) fp32 in GMEM
        blk, ci, bi = (lax.axis_index(a) for a in ("heads", "c", "b"))
        head0 = blk * hb
        rows = pl.ds(ci * k, k)
        wg = lax.axis_index("wg")

        @pl.when(wg == 1)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")
            plgpu.copy_gmem_to_smem(b_ref.at[bi, rows, head0 // r], b_smem, b_ready)

            @pl.loop(0, hb)
            def _head(hh):
                slot = lax.rem(hh, slots)

                @pl.when(hh >= slots)
                def _():
                    plgpu.barrier_wait(head_free.at[slot])

                plgpu.copy_gmem_to_smem(
                    x_ref.at[bi, rows, head0 + hh], x_smem.at[slot], head_ready.at[slot]
                )
                plgpu.copy_gmem_to_smem(
                    w_ref.at[bi, head0 + hh, ci], w_smem.at[slot], head_ready.at[slot]
                )

            _await_last_uses(head_free, hb, slots)

        @pl.when(wg == 0)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            plgpu.barrier_wait(b_ready)

            @pl.loop(0, hb)
            def _head(hh):
                slot = lax.rem(hh, slots)
                plgpu.barrier_wait(head_ready.at[slot])
                x_kp, w_k = x_smem.at[slot], w_smem.at[slot]
                # x rows times w, rounded to the matmul dtype (as the Triton kernel does),
                # written back in place: wgmma's left operand must come from shared memory
                # to be read transposed.
                for start in range(0, k, ROWS):
                    part = pl.ds(start, ROWS)
                    xs = ops.load(x_kp.at[part], plgpu.Layout.WGMMA).astype(F32)
                    ws = ops.load(w_k.at[part], plgpu.Layout.WGMMA.reduce(1))
                    x_kp[part] = (xs * lax.broadcast_in_dim(ws, xs.shape, [0])).astype(dtype)
                plgpu.commit_smem()  # the generic-proxy stores become visible to wgmma

                s_pn = ops.matmul(x_kp, b_smem, trans_a=True)
                plgpu.barrier_arrive(head_free.at[slot])
                # The store issued from this staging slot two heads ago must have read it.
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                s_smem[slot] = s_pn
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(s_smem.at[slot], s_ref.at[bi, ci, head0 + hh])

            plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(
        chunk_state,  # names the kernel in profiles
        out_type=jax.ShapeDtypeStruct((b, c, h, p, n), F32),
        scratch_types=[
            *smem,
            plgpu.Barrier(num_barriers=1),
            plgpu.Barrier(num_arrivals=2, num_barriers=slots),  # x and w landed
            plgpu.Barrier(num_arrivals=1, num_barriers=slots),  # slot read by the matmul
        ],
        grid=(h // hb, c, b),
        grid_names=("heads", "c", "b"),
        num_threads=2,
        thread_name="wg",
        compiler_params=_compiler_params(),
        interpret=params,
    )
    return kernel(x, w_bhck, B)


def _await_last_uses(free, num_heads, slots):
    """Wait for the last use of each buffer slot too: every phase of a barrier a thread waits
    on gets observed (the interpreter checks it; it costs an idle memory warpgroup nothing)."""
    for hh in range(max(num_heads - slots, 0), num_heads):
        plgpu.barrier_wait(free.at[hh % slots])


def _check_smem(what, buffers):
    """ValueError if the buffers exceed a Hopper block's shared memory."""
    total = sum(_nbytes(buf.shape, buf.dtype) for buf in buffers)
    if total > _SMEM_BYTES:
        raise ValueError(f"{what}: needs {total} bytes of shared memory > {_SMEM_BYTES}")


# ---------------------------------------------------------------- chunk_out


def chunk_outputs_mgpu(prep, h_in, *, interpret=None):
    """y (b, l', h, p') in prep.out_dtype from the incoming states h_in (b, c, h, p', n') in the
    matmul dtype. Same contract as kernel.chunk_outputs."""
    _check(prep, "chunk_outputs_mgpu")
    b, _, h, _, g, _ = prep.shape
    p, n, c, k = prep.p_pad, prep.n_pad, prep.c, prep.k
    r = h // g
    hb = _heads_per_program(prep)
    dtype, out_dtype = prep.mm_dtype, prep.out_dtype
    if h_in.dtype != dtype:
        raise ValueError(f"chunk_outputs_mgpu: h_in must be {dtype}, got {h_in.dtype}")
    halves = k // (2 * ROWS)  # programs per chunk: 128 target rows each, 64 per warpgroup
    slots = 2
    params = mosaic_gpu_interpret_params(interpret, num_threads=3)
    ops = _Ops(params is not None)
    smem = [
        _smem((2 * ROWS, n), dtype),  # C of this program's target rows
        _smem((k, n), dtype),  # B of the chunk
        plgpu.SMEM((k,), jnp.int32),  # document ids of the chunk
        _smem((slots, k, p), dtype),  # x
        _smem((slots, p, n), dtype),  # H entering the chunk
        plgpu.SMEM((slots, 3, k), F32),  # cs, dt, w_out
        plgpu.SMEM((slots, ROWS), F32),  # D, repeated
        _smem((2, ROWS, p), out_dtype),  # y of each warpgroup, staged for the TMA store
    ]
    _check_smem("chunk_outputs_mgpu", smem)
    # D repeated over one tile's rows: a TMA-sized vector instead of a scalar read from GMEM.
    d_rep = jnp.broadcast_to(prep.D[:, None], (h, ROWS))
    vec_bhc3k = jnp.stack([prep.cs, prep.dt, prep.w_out], axis=3)

    def chunk_out(
        x_ref,
        c_ref,
        b_ref,
        seq_ref,
        vec_ref,
        h_ref,
        d_ref,
        y_ref,
        c_smem,
        b_smem,
        seq_smem,
        x_smem,
        h_smem,
        vec_smem,
        d_smem,
        y_smem,
        chunk_ready,
        head_ready,
        head_free,
    ):
        # inputs: x_ref (b, l', h, p), c_ref / b_ref (b, l', g, n), seq_ref (b, c, k) int32,
        #   vec_ref (b, h, c, 3, k) fp32 [cs, dt, w_out], h_ref (b, c, h, p, n), d_ref (h, 64)
        # outputs: y_ref (b, l', h, p)
        blk, ci, bhalf = (lax.axis_index(a) for a in ("heads", "c", "bhalf"))
        bi = lax.div(bhalf, halves)
        # The last half of a chunk has the most source tiles: start it first.
        half = halves - 1 - lax.rem(bhalf, halves)
        head0 = blk * hb
        grp = head0 // r
        rows = pl.ds(ci * k, k)
        wg = lax.axis_index("wg")

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")
            target = pl.ds(ci * k + half * 2 * ROWS, 2 * ROWS)
            plgpu.copy_gmem_to_smem(c_ref.at[bi, target, grp], c_smem, chunk_ready)
            plgpu.copy_gmem_to_smem(b_ref.at[bi, rows, grp], b_smem, chunk_ready)
            plgpu.copy_gmem_to_smem(seq_ref.at[bi, ci], seq_smem, chunk_ready)

            @pl.loop(0, hb)
            def _head(hh):
                slot = lax.rem(hh, slots)
                hd = head0 + hh

                @pl.when(hh >= slots)
                def _():
                    plgpu.barrier_wait(head_free.at[slot])

                ready = head_ready.at[slot]
                plgpu.copy_gmem_to_smem(x_ref.at[bi, rows, hd], x_smem.at[slot], ready)
                plgpu.copy_gmem_to_smem(h_ref.at[bi, ci, hd], h_smem.at[slot], ready)
                plgpu.copy_gmem_to_smem(vec_ref.at[bi, hd, ci], vec_smem.at[slot], ready)
                plgpu.copy_gmem_to_smem(d_ref.at[hd], d_smem.at[slot], ready)

            _await_last_uses(head_free, hb, slots)

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            i = half * 2 + wg  # this warpgroup's target tile: chunk rows i*64 .. i*64+63
            rows_s = pl.ds(i * ROWS, ROWS)
            c_s = c_smem.at[pl.ds(wg * ROWS, ROWS)]
            col, row = plgpu.Layout.WGMMA.reduce(0), plgpu.Layout.WGMMA.reduce(1)
            pos_s, pos_t = ops.iota((ROWS, ROWS), 0), ops.iota((ROWS, ROWS), 1)
            plgpu.barrier_wait(chunk_ready)
            seq_s = lax.broadcast_in_dim(ops.load(seq_smem.at[rows_s], row), (ROWS, ROWS), [0])

            @pl.loop(0, hb)
            def _head(hh):
                slot = lax.rem(hh, slots)
                plgpu.barrier_wait(head_ready.at[slot])
                x_kp, h_pn, vec = x_smem.at[slot], h_smem.at[slot], vec_smem.at[slot]

                state_sp = ops.matmul(c_s, h_pn, trans_b=True)
                cs_s = lax.broadcast_in_dim(ops.load(vec.at[0, rows_s], row), (ROWS, ROWS), [0])

                def source_tile(j, acc_sp):
                    cols = pl.ds(j * ROWS, ROWS)
                    cb_st = ops.matmul(c_s, b_smem.at[cols], trans_b=True)
                    cs_t = ops.load(vec.at[0, cols], col)
                    dt_t = ops.load(vec.at[1, cols], col)
                    seq_t = ops.load(seq_smem.at[cols], col)
                    same_doc = seq_s == lax.broadcast_in_dim(seq_t, (ROWS, ROWS), [1])
                    keep = same_doc & (pos_t + j * ROWS <= pos_s + i * ROWS)
                    log_decay = cs_s - lax.broadcast_in_dim(cs_t, (ROWS, ROWS), [1])
                    # exp never sees the masked (possibly huge) values (kernel.masked_exp).
                    decay = jnp.exp(jnp.where(keep, log_decay, 0.0))
                    weights = cb_st * decay * lax.broadcast_in_dim(dt_t, (ROWS, ROWS), [1])
                    scores_st = jnp.where(keep, weights, 0.0).astype(dtype)
                    return ops.matmul_acc(acc_sp, scores_st, x_kp.at[cols])

                y_sp = lax.fori_loop(0, i + 1, source_tile, ops.zeros((ROWS, p)))
                w_out = ops.load(vec.at[2, rows_s], row)
                d_s = ops.load(d_smem.at[slot], row)
                x_s = ops.load(x_kp.at[rows_s], plgpu.Layout.WGMMA).astype(F32)
                plgpu.barrier_arrive(head_free.at[slot])
                y_sp += lax.broadcast_in_dim(w_out, (ROWS, p), [0]) * state_sp
                y_sp += lax.broadcast_in_dim(d_s, (ROWS, p), [0]) * x_s
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # last head's y store
                y_smem[wg] = y_sp.astype(out_dtype)
                plgpu.commit_smem()
                out_rows = pl.ds(ci * k + i * ROWS, ROWS)
                plgpu.copy_smem_to_gmem(y_smem.at[wg], y_ref.at[bi, out_rows, head0 + hh])

            plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(
        chunk_out,
        out_type=jax.ShapeDtypeStruct(prep.x.shape, out_dtype),
        scratch_types=[
            *smem,
            plgpu.Barrier(num_arrivals=3, num_barriers=1),  # C, B and seq landed
            plgpu.Barrier(num_arrivals=4, num_barriers=slots),  # x, H, vectors, D landed
            plgpu.Barrier(num_arrivals=2, num_barriers=slots),  # both warpgroups done
        ],
        # Heads vary fastest: programs of one chunk run together and share its B / C in L2.
        grid=(h // hb, c, b * halves),
        grid_names=("heads", "c", "bhalf"),
        num_threads=3,
        thread_name="wg",
        compiler_params=_compiler_params(),
        interpret=params,
    )
    return kernel(prep.x, prep.C, prep.B, prep.seq, vec_bhc3k, h_in, d_rep)
