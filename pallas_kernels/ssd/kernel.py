"""Mamba-2 SSD in Pallas: the chunked algorithm as five kernels plus small scans and matmuls.

Forward (Dao & Gu, arXiv:2405.21060 §6): with cs the within-chunk cumulative log-decay,
    chunk_state:  S_c = sum_t w_state[t] dt[t] x_t B_t^T                       (p, n) per chunk
    pass:         H_in[c+1] = decay_c H_in[c] + S_c                            state passing
    chunk_out:    y_s = sum_{t<=s} (C_s.B_t) L[s,t] dt_t x_t + w_out[s] H_in C_s + D x_s
with L[s,t] = exp(cs_s - cs_t), w_out[s] = exp(cs_s), w_state[t] = exp(cs_K - cs_t) and
decay_c = exp(cs_K), each zeroed where seq_idx says the positions belong to different
documents. Backward: chunk_state again (on dy, C, w_out) for the state gradient, a reverse scan
of it, then per source tile t grad_dx (one head) and grad_bc (dB, dC and the decay terms of a
block of heads). grad_bc loops over heads inside the loop over target tiles s: per head the
one product x_t . dy_s serves dB, dC and both decay row sums, and the heads' dt G L matrices are
summed before the two matmuls with C_s and B_t; dC and the target-side row sums leave it as
per-source-tile partials that JAX sums. The per-position decay gradient is assembled in JAX from
the kernels' row sums; ddt is never obtained by dividing by dt.

C_s . B_t of every pair in a chunk is one batched matmul in XLA, shared by the heads of a
group and stored in the matmul dtype (the kernels round C.B L to it before their matmuls
anyway; bf16 halves the largest load); the kernels read its (tile, tile) blocks. Kernels see
one chunk and a block of heads at a time, tiled by `tile` rows; nothing of size
(b, l, h, p, n) is written. Variants: "gpu" keeps
the (b, l, h, p) layout of the caller (strided blocks are free for Triton) and passes states
over chunks with a small kernel; "tpu" moves heads in front so every block ends in two
whole-or-tiled dims, and passes states with a lax.scan. On Hopper, chunk_state and chunk_out
are the Mosaic GPU kernels of kernel_mgpu.py (wgmma, TMA; measured faster) when the inputs suit
them and XLA keeps custom calls out of its CUDA graphs, else the Triton ones here. Letters:
b batch, h head, g group, c chunk, k chunk length, s / t target / source position, p head dim,
n state dim.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ..backend import compiler_params, interpret_for
from . import kernel_mgpu
from .grad_kernels import grad_bc_kernel, grad_dx_kernel
from .reference import run_ids
from .tiles import F32, Head, causal_keep, dot, head, masked_exp, positions


def _round_up_pow2(n, minimum):
    """The next power of two >= max(n, minimum)."""
    return max(minimum, 1 << max(0, (n - 1).bit_length()))


# ---------------------------------------------------------------- kernels


def _chunk_state_kernel(x_ref, w_ref, b_ref, out_ref, *, tile, seq_major):
    """out (p, n) = sum_t w[t] x[t]^T b[t] over the chunk (fp32), one head."""
    x_ref, w_ref, out_ref = head(x_ref, 0, seq_major), Head(w_ref, 0), Head(out_ref, 0)
    k, p = x_ref.shape
    n = b_ref.shape[-1]

    def body(j, acc_pn):
        rows = pl.ds(pl.multiple_of(j * tile, tile), tile)
        xw = (x_ref[rows, :].astype(F32) * w_ref[rows, :]).astype(x_ref.dtype)
        return acc_pn + dot(xw, b_ref[rows, :], trans_a=True)

    out_ref[...] = jax.lax.fori_loop(0, k // tile, body, jnp.zeros((p, n), F32))


def _chunk_out_kernel(
    x_ref, cb_ref, c_ref, cs_c_ref, cs_r_ref, dt_r_ref, seq_c_ref, seq_r_ref, wout_ref,
    h_ref, d_ref, y_ref, *, tile, seq_major,
):  # fmt: skip
    """y for target tile i of one head: the causal intra-chunk sum, the incoming state, D x."""
    x_ref, y_ref = head(x_ref, 0, seq_major), head(y_ref, 0, seq_major)
    cs_c_ref, cs_r_ref, dt_r_ref, wout_ref, h_ref, d_ref = (
        Head(ref, 0) for ref in (cs_c_ref, cs_r_ref, dt_r_ref, wout_ref, h_ref, d_ref)
    )
    i = pl.program_id(3)
    rows_s = pl.ds(pl.multiple_of(i * tile, tile), tile)
    c_s = c_ref[rows_s, :]
    cs_s, seq_s = cs_c_ref[rows_s, :], seq_c_ref[rows_s, :]
    pos_s = positions(i * tile, tile, as_row=False)

    def body(j, acc_sp):
        start = pl.multiple_of(j * tile, tile)
        cols = pl.ds(start, tile)
        keep = causal_keep(seq_s, seq_r_ref[:, cols], pos_s, positions(start, tile, True))
        decay_st = masked_exp(keep, cs_s - cs_r_ref[:, cols])
        scores_st = cb_ref[rows_s, cols] * decay_st * dt_r_ref[:, cols]
        return acc_sp + dot(scores_st.astype(x_ref.dtype), x_ref[cols, :])

    acc_sp = jax.lax.fori_loop(0, i + 1, body, jnp.zeros((tile, x_ref.shape[1]), F32))
    state_sp = dot(c_s, h_ref[...].astype(c_s.dtype), trans_b=True)
    acc_sp += wout_ref[rows_s, :] * state_sp + d_ref[0, 0] * x_ref[rows_s, :].astype(F32)
    y_ref[...] = acc_sp.astype(y_ref.dtype)


# ---------------------------------------------------------------- layout and launch


class _Layout:
    """Block specs of one variant for grids (b, head block, c) and (b, head block, c, tile).

    A program sees `hb` consecutive heads (of one group). gpu: x-like (b, l, h, p), B-like
    (b, l, g, n); tpu: x-like (b, h, l, p), B-like (b, g, l, n). Per-position vectors are
    (b, h, c, k, 1) columns and (b, h, c, 1, k) rows; seq ids (b, c, k, 1) / (b, c, 1, k);
    states (b, c, h, p, n); D (h, 1, 1); per-head-block sums x-like with h / hb "heads"."""

    def __init__(self, variant, k, tile, r, hb=1):
        self.variant, self.k, self.tile, self.hb = variant, k, tile, hb
        self.blocks_per_group = r // hb
        self.gpu = variant == "gpu"

    def seq_major(self, arr):
        """A (b, l, h, f) array in this variant's layout."""
        return arr if self.gpu else jnp.moveaxis(arr, 2, 1)

    def from_seq_major(self, arr):
        """Back to (b, l, h, f)."""
        return arr if self.gpu else jnp.moveaxis(arr, 1, 2)

    def _x_like(self, rows, heads, f, row_block, head_block):
        """Block (rows, heads, f) of an x-like array in this layout."""
        if self.gpu:
            return pl.BlockSpec(
                (None, rows, heads, f),
                lambda b, hb, c, *i: (b, row_block(c, *i), head_block(hb), 0),
            )
        return pl.BlockSpec(
            (None, heads, rows, f), lambda b, hb, c, *i: (b, head_block(hb), row_block(c, *i), 0)
        )

    def chunk(self, f):
        """The whole chunk of an x-like array, this program's heads."""
        return self._x_like(self.k, self.hb, f, lambda c, *i: c, lambda hb: hb)

    def group_chunk(self, f):
        """The whole chunk of a B-like array, this program's group."""
        per = self.blocks_per_group
        return self._x_like(self.k, None, f, lambda c, *i: c, lambda hb: jax.lax.div(hb, per))

    def tile_of(self, f, heads=True):
        """Tile i of chunk c of an x-like array (this program's heads), or of a per-head-block
        sum (heads=False)."""
        per = self.k // self.tile
        return self._x_like(
            self.tile, self.hb if heads else None, f, lambda c, i: c * per + i, lambda hb: hb
        )

    def scores(self):
        """The chunk's C B^T (k, k) of this program's group, from (b, c, g, k, k)."""
        per = self.blocks_per_group
        return pl.BlockSpec(
            (None, None, None, self.k, self.k),
            lambda b, hb, c, *i: (b, c, jax.lax.div(hb, per), 0, 0),
        )

    def column(self):
        """Per-position (b, h, c, k, 1) vectors, whole chunk."""
        return pl.BlockSpec((None, self.hb, None, self.k, 1), lambda b, hb, c, *i: (b, hb, c, 0, 0))

    def row(self):
        """Per-position (b, h, c, 1, k) vectors, whole chunk."""
        return pl.BlockSpec((None, self.hb, None, 1, self.k), lambda b, hb, c, *i: (b, hb, c, 0, 0))

    def score_rows(self):
        """Rows of tile i of a (b, c, h / hb, k, k) per-head-block score gradient."""
        return pl.BlockSpec(
            (None, None, None, self.tile, self.k), lambda b, hb, c, i: (b, c, hb, i, 0)
        )

    def row_partial(self):
        """Per source tile i, (b, h, c, k / tile, 1, k) per-position partial rows."""
        return pl.BlockSpec(
            (None, self.hb, None, None, 1, self.k), lambda b, hb, c, i: (b, hb, c, i, 0, 0)
        )

    def per_tile_scalar(self):
        """One (1, 1) value per program of a (b, h, c, k / tile, 1, 1) array (one head per
        program)."""
        return pl.BlockSpec((None, None, None, None, 1, 1), lambda b, hb, c, i: (b, hb, c, i, 0, 0))

    def column_tile(self):
        """Tile i of per-position columns (outputs)."""
        return pl.BlockSpec(
            (None, self.hb, None, self.tile, 1), lambda b, hb, c, i: (b, hb, c, i, 0)
        )

    def seq_column(self):
        """Document ids (b, c, k, 1) of the chunk."""
        return pl.BlockSpec((None, None, self.k, 1), lambda b, hb, c, *i: (b, c, 0, 0))

    def seq_row(self):
        """Document ids (b, c, 1, k) of the chunk."""
        return pl.BlockSpec((None, None, 1, self.k), lambda b, hb, c, *i: (b, c, 0, 0))

    def state(self, p, n):
        """The chunk's (hb, p, n) states of a (b, c, h, p, n) array."""
        return pl.BlockSpec((None, None, self.hb, p, n), lambda b, hb, c, *i: (b, c, hb, 0, 0))

    def scalar(self):
        """D of this program's heads, stored (h, 1, 1)."""
        return pl.BlockSpec((self.hb, 1, 1), lambda b, hb, c, *i: (hb, 0, 0))


def _call(kernel, layout, grid, in_specs, out_specs, out_shape, *, interpret, num_warps,
          num_stages):  # fmt: skip
    """pallas_call with this variant's compiler parameters."""
    variant = layout.variant
    return pl.pallas_call(
        functools.partial(kernel, tile=layout.tile, seq_major=layout.gpu),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params(
            variant,
            num_warps=num_warps,
            num_stages=num_stages,
            dimension_semantics=("parallel",) * len(grid),
        ),
        interpret=interpret_for(variant, interpret),
    )


class Prepared:
    """The padded, laid-out inputs and the decay vectors shared by forward and backward."""

    def __init__(self, x, dt, A, B, C, D, seq_idx, chunk_size, variant, sizes):
        b, l, h, p = x.shape
        g, n = B.shape[2:]
        self.shape = (b, l, h, p, g, n)
        self.dtype = F32  # the kernels compute in fp32 (ops refuses fp64 inputs)
        self.out_dtype = x.dtype
        k = chunk_size
        c = -(-l // k)
        self.c, self.k = c, k
        self.mm_dtype = jnp.promote_types(x.dtype, B.dtype)  # inputs of the matmuls
        pad_l = c * k - l
        if variant == "gpu":  # Triton: power-of-two tiles of at least 16 for tl.dot
            self.p_pad, self.n_pad = _round_up_pow2(p, 16), _round_up_pow2(n, 16)
        else:
            self.p_pad, self.n_pad = p, n
        self.sizes = sizes  # resolved BlockSizes
        self.layout = _Layout(variant, k, sizes.tile, h // g)
        self.grad_layout = _Layout(variant, k, sizes.tile_bwd, h // g, sizes.heads_per_block)
        self.dx_layout = _Layout(variant, k, sizes.tile_bwd, h // g)

        def pad(arr, f_pad):
            """Zero-pad the length to c * k and the feature dim to f_pad, in the mm dtype."""
            widths = [(0, 0), (0, pad_l), (0, 0), (0, f_pad - arr.shape[-1])]
            return jnp.pad(arr.astype(self.mm_dtype), widths)

        self.x = self.layout.seq_major(pad(x, self.p_pad))
        self.B = self.layout.seq_major(pad(B, self.n_pad))
        self.C = self.layout.seq_major(pad(C, self.n_pad))
        dt_bhck = jnp.pad(dt.astype(self.dtype), [(0, 0), (0, pad_l), (0, 0)])
        self.dt = jnp.moveaxis(dt_bhck, 2, 1).reshape(b, h, c, k)
        seq_bl = jnp.zeros((b, l), jnp.int32) if seq_idx is None else run_ids(seq_idx)
        self.seq = jnp.pad(seq_bl, [(0, 0), (0, pad_l)], mode="edge").reshape(b, c, k)
        self.A = A.astype(self.dtype)
        self.cs = jnp.cumsum(self.dt * self.A[:, None, None], axis=-1)
        self.D = jnp.zeros((h,), self.dtype) if D is None else D.astype(self.dtype)

        # Documents: the state entering chunk c belongs to doc_in[c] (the row's first document
        # for chunk 0); it survives the chunk only if the chunk ends in that document.
        doc_in_bc = jnp.concatenate([self.seq[:, :1, 0], self.seq[:, :-1, -1]], axis=1)
        own_bhck = (self.seq == doc_in_bc[:, :, None])[:, None]
        end_bhck = (self.seq == self.seq[:, :, -1:])[:, None]
        cs_end = self.cs[..., -1:]
        self.w_out = jnp.where(own_bhck, jnp.exp(self.cs), 0.0)
        self.w_state = jnp.where(end_bhck, jnp.exp(cs_end - self.cs), 0.0)
        keep_bhc = (self.seq[:, :, -1] == doc_in_bc)[:, None]
        self.decay = jnp.where(keep_bhc, jnp.exp(cs_end[..., 0]), 0.0)

    def scores(self, transposed=False):
        """C_s . B_t for every pair of positions of each chunk: (b, c, g, k, k) in the matmul
        dtype, indexed [s, t] (or [t, s] if transposed, for the source-tile kernels: a
        transposed load would go through shared memory), one batched matmul (fp32 accumulation)
        shared by all heads of a group."""
        b, _, _, _, g, _ = self.shape
        c, k = self.c, self.k
        out = "bcgts" if transposed else "bcgst"
        if self.layout.gpu:
            B, C = (v.reshape(b, c, k, g, self.n_pad) for v in (self.B, self.C))
            cb = jnp.einsum(f"bcsgn,bctgn->{out}", C, B, preferred_element_type=F32)
        else:
            B, C = (v.reshape(b, g, c, k, self.n_pad) for v in (self.B, self.C))
            cb = jnp.einsum(f"bgcsn,bgctn->{out}", C, B, preferred_element_type=F32)
        return cb.astype(self.mm_dtype)

    def score_grads(self, dcb):
        """(dB, dC) (b, l', g, n') fp32 through the scores C_s . B_t given their gradient
        dcb (b, c, g, k, k) indexed [t, s]: dB_t = sum_s dcb[t, s] C_s, dC_s = sum_t dcb[t, s] B_t
        (batched matmuls, fp32 accumulation)."""
        b, _, _, _, g, _ = self.shape
        c, k = self.c, self.k
        seq = self.layout.from_seq_major
        B, C = (seq(v).reshape(b, c, k, g, self.n_pad) for v in (self.B, self.C))
        db = jnp.einsum("bcgts,bcsgn->bctgn", dcb, C, preferred_element_type=F32)
        dc = jnp.einsum("bcgts,bctgn->bcsgn", dcb, B, preferred_element_type=F32)
        return (v.reshape(b, c * k, g, self.n_pad) for v in (db, dc))

    def vectors(self, *arrays):
        """(b, h, c, k) fp32 arrays as (b, h, c, k, 1) columns / (b, h, c, 1, k) rows."""
        return [a[..., None] for a in arrays] + [a[..., None, :] for a in arrays]

    def crop(self, arr_blhf, f):
        """Drop the length and feature padding of a (b, l', h, f') array."""
        _, l, *_ = self.shape
        return arr_blhf[:, :l, :, :f]


def chunk_states(prep, x, w_bhck, B, *, interpret=None):
    """S (b, c, h, p', n') fp32: per chunk sum_t w[t] x[t]^T B[t] (x-like, B-like inputs)."""
    lay = prep.layout
    b, _, h, *_ = prep.shape
    p, n = prep.p_pad, prep.n_pad
    return _call(
        _chunk_state_kernel,
        lay,
        (b, h, prep.c),
        [lay.chunk(p), lay.column(), lay.group_chunk(n)],
        lay.state(p, n),
        jax.ShapeDtypeStruct((b, prep.c, h, p, n), F32),
        interpret=interpret,
        num_warps=prep.sizes.num_warps,
        num_stages=prep.sizes.num_stages,
    )(x, w_bhck[..., None], B)


def _pass_kernel(s_ref, decay_ref, h0_ref, *refs, reverse):
    """One (b, h, block of p rows): out[c] = the carry entering chunk c, carry = decay[c] *
    carry + s[c], over the chunks in order (or in reverse); last = the carry after all of them.
    With an `other` input (reverse: the forward's H_in), also dots[c] = sum(out[c] * other[c])
    over the block."""
    other_ref, out_ref, last_ref, dots_ref = refs if len(refs) == 4 else (None, *refs, None)
    num = s_ref.shape[0]

    def body(j, carry_pn):
        ci = num - 1 - j if reverse else j
        out_ref[ci] = carry_pn.astype(out_ref.dtype)
        if other_ref is not None:
            dots_ref[ci] = jnp.sum(carry_pn * other_ref[ci].astype(F32))
        return decay_ref[ci] * carry_pn + s_ref[ci]

    last_ref[...] = jax.lax.fori_loop(0, num, body, h0_ref[...])


def _pass(prep, s_bchpn, h0_bhpn, *, reverse, other=None, interpret=None):
    """(carries (b, c, h, p', n') of the linear recurrence over chunks, last carry, and with
    `other` (b, c, h, p', n') the per-chunk sums of carries * other (b, h, c), else None).

    The carry runs in fp32; the carries are stored in the matmul dtype, which is all their
    readers use (they feed the kernels' matmuls; mamba_ssm keeps passed states in the inputs'
    dtype too): bf16 inputs halve this largest traffic of the state path. The last carry (the
    final state) stays fp32.

    gpu: a Pallas kernel, one program per (b, h, block of 16 rows of p) with the carry in
    registers (splitting p: b h programs alone are too few to hide the loads' latency); tpu:
    a lax.scan."""
    if not prep.layout.gpu:

        def step(carry_bhpn, inputs):
            decay_bh, s_bhpn = inputs
            return decay_bh[..., None, None] * carry_bhpn + s_bhpn, carry_bhpn

        xs = (jnp.moveaxis(prep.decay, 2, 0), jnp.moveaxis(s_bchpn, 1, 0))
        last, out_cbhpn = jax.lax.scan(step, h0_bhpn, xs, reverse=reverse)
        out = jnp.moveaxis(out_cbhpn, 0, 1)
        dots = None
        if other is not None:
            dots = jnp.einsum("bchpn,bchpn->bhc", out, other.astype(F32))
        return out.astype(prep.mm_dtype), last, dots
    b, c, h, p, n = s_bchpn.shape
    bp = min(p, 16)
    grid = (b, h, p // bp)
    state = pl.BlockSpec((None, None, bp, n), lambda bi, hi, pi: (bi, hi, pi, 0))
    chunks = pl.BlockSpec((None, c, None, bp, n), lambda bi, hi, pi: (bi, 0, hi, pi, 0))
    per_chunk = pl.BlockSpec((None, None, c), lambda bi, hi, pi: (bi, hi, 0))
    in_specs = [chunks, per_chunk, state]
    out_specs = [chunks, state]
    out_shape = [
        jax.ShapeDtypeStruct(s_bchpn.shape, prep.mm_dtype),
        jax.ShapeDtypeStruct(h0_bhpn.shape, F32),
    ]
    args = [s_bchpn, prep.decay, h0_bhpn]
    if other is not None:
        in_specs.append(chunks)
        args.append(other)
        out_specs.append(pl.BlockSpec((None, None, None, c), lambda bi, hi, pi: (bi, hi, pi, 0)))
        out_shape.append(jax.ShapeDtypeStruct((b, h, p // bp, c), F32))
    outs = pl.pallas_call(
        functools.partial(_pass_kernel, reverse=reverse),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params("gpu", num_warps=4, num_stages=1),
        interpret=interpret_for("gpu", interpret),
    )(*args)
    dots = None if other is None else outs[2].sum(axis=2)
    return outs[0], outs[1], dots


def pass_states(prep, S_bchpn, h0_bhpn, interpret=None):
    """(H_in (b, c, h, p', n') entering each chunk in the matmul dtype, final state fp32)."""
    h_in, final, _ = _pass(prep, S_bchpn, h0_bhpn, reverse=False, interpret=interpret)
    return h_in, final


def pass_state_grads(prep, dS_bchpn, dfinal_bhpn, h_in, interpret=None):
    """Reverse: (dH_out (b, c, h, p', n') leaving each chunk, d initial state, and the
    per-chunk sums of dH_out * H_in (b, h, c): the decay's gradient through the carry)."""
    return _pass(prep, dS_bchpn, dfinal_bhpn, reverse=True, other=h_in, interpret=interpret)


def pad_state(prep, state_bhpn):
    """A (b, h, p, n) state in fp32, zero-padded to (p', n')."""
    _, _, _, p, _, n = prep.shape
    if state_bhpn is None:
        b, _, h, *_ = prep.shape
        return jnp.zeros((b, h, prep.p_pad, prep.n_pad), F32)
    widths = [(0, 0), (0, 0), (0, prep.p_pad - p), (0, prep.n_pad - n)]
    return jnp.pad(state_bhpn.astype(F32), widths)


def chunk_outputs(prep, h_in, *, interpret=None):
    """y (b, l', h, p') in the variant's layout from the incoming states."""
    lay = prep.layout
    b, _, h, *_ = prep.shape
    p, n = prep.p_pad, prep.n_pad
    cs_c, dt_c, wout_c, cs_r, dt_r, _ = prep.vectors(prep.cs, prep.dt, prep.w_out)
    grid = (b, h, prep.c, prep.k // lay.tile)
    in_specs = [
        lay.chunk(p), lay.scores(), lay.group_chunk(n), lay.column(), lay.row(),
        lay.row(), lay.seq_column(), lay.seq_row(), lay.column(), lay.state(p, n), lay.scalar(),
    ]  # fmt: skip
    return _call(
        _chunk_out_kernel,
        lay,
        grid,
        in_specs,
        lay.tile_of(p),
        jax.ShapeDtypeStruct(prep.x.shape, prep.out_dtype),
        interpret=interpret,
        num_warps=prep.sizes.num_warps,
        num_stages=prep.sizes.num_stages,
    )(
        prep.x, prep.scores(), prep.C, cs_c, cs_r, dt_r, prep.seq[..., None], prep.seq[:, :, None],
        wout_c, h_in, prep.D[:, None, None],
    )  # fmt: skip


def _chunk_kernels(prep, interpret):
    """(chunk_states, chunk_outputs): the Mosaic GPU twins where `kernel_mgpu.use_mosaic_gpu`
    says (Hopper, measured faster), else the Triton / Mosaic TPU ones above."""
    if kernel_mgpu.use_mosaic_gpu(prep, prep.sizes.mosaic_gpu, interpret):
        return kernel_mgpu.chunk_states_mgpu, kernel_mgpu.chunk_outputs_mgpu
    return chunk_states, chunk_outputs


def forward(x, dt, A, B, C, D, initial_state, seq_idx, *, chunk_size, variant, sizes,
            interpret=None):  # fmt: skip
    """(y (b, l, h, p) in x.dtype, final state (b, h, p, n) fp32, residuals for backward);
    `sizes` are resolved BlockSizes."""
    prep = Prepared(x, dt, A, B, C, D, seq_idx, chunk_size, variant, sizes)
    states, outputs = _chunk_kernels(prep, interpret)
    S = states(prep, prep.x, prep.w_state * prep.dt, prep.B, interpret=interpret)
    h_in, final = pass_states(prep, S, pad_state(prep, initial_state), interpret)
    y = outputs(prep, h_in, interpret=interpret)
    _, _, _, p, _, n = prep.shape
    y = prep.crop(prep.layout.from_seq_major(y), p)
    return y, final[:, :, :p, :n], h_in


def backward(x, dt, A, B, C, D, initial_state, seq_idx, h_in, dy, dfinal, *, chunk_size,
             variant, sizes, interpret=None):  # fmt: skip
    """Gradients (dx, ddt, dA, dB, dC, dD, d initial_state) of forward's (y, final state)."""
    prep = Prepared(x, dt, A, B, C, D, seq_idx, chunk_size, variant, sizes)
    lay = prep.layout
    b, l, h, p, g, n = prep.shape
    pp, nn, c, k = prep.p_pad, prep.n_pad, prep.c, prep.k
    dy_pad = jnp.pad(dy.astype(prep.mm_dtype), [(0, 0), (0, c * k - l), (0, 0), (0, pp - p)])
    dy_l = lay.seq_major(dy_pad)

    # State gradients: what y asks of each incoming state, then the reverse scan over chunks.
    states, _ = _chunk_kernels(prep, interpret)
    dS = states(prep, dy_l, prep.w_out, prep.C, interpret=interpret)
    dh_out, dh0, carry_dots = pass_state_grads(prep, dS, pad_state(prep, dfinal), h_in, interpret)

    cs_c, dt_c, wout_c, wst_c, cs_r, _, _, _ = prep.vectors(
        prep.cs, prep.dt, prep.w_out, prep.w_state
    )
    seq_c, seq_r = prep.seq[..., None], prep.seq[:, :, None]
    lay = prep.grad_layout
    blocks = h // lay.hb
    grid = (b, blocks, c, k // lay.tile)
    col_out = jax.ShapeDtypeStruct((b, h, c, k, 1), F32)
    sum_shape = (b, c * k, blocks, nn) if lay.gpu else (b, blocks, c * k, nn)
    sum_out = jax.ShapeDtypeStruct(sum_shape, F32)
    cbt = prep.scores(transposed=True)
    one = prep.dx_layout
    tiles = k // lay.tile
    dx, dd_part = _call(
        grad_dx_kernel,
        one,
        (b, h, c, k // one.tile),
        [
            one.chunk(pp),
            one.tile_of(pp),
            one.group_chunk(nn),
            one.scores(),
            one.column(),
            one.row(),
            one.column(),
            one.seq_column(),
            one.seq_row(),
            one.column(),
            one.state(pp, nn),
            one.scalar(),
        ],
        [one.tile_of(pp), one.per_tile_scalar()],
        [
            jax.ShapeDtypeStruct(prep.x.shape, x.dtype),
            jax.ShapeDtypeStruct((b, h, c, k // one.tile, 1, 1), F32),
        ],
        interpret=interpret,
        num_warps=prep.sizes.num_warps_bwd,
        num_stages=prep.sizes.num_stages_bwd,
    )(
        dy_l, prep.x, prep.B, cbt, cs_c, cs_r, dt_c, seq_c, seq_r, wst_c, dh_out,
        prep.D[:, None, None],
    )  # fmt: skip
    dcb_shape = (b, c, blocks, k, k)
    dcb, ddt_intra, v, db_state, dc_state, rowsum_part, u = _call(
        grad_bc_kernel,
        lay,
        grid,
        [lay.chunk(pp), lay.chunk(pp), lay.group_chunk(nn), lay.group_chunk(nn), lay.scores(),
         lay.column(), lay.row(), lay.column(), lay.seq_column(), lay.seq_row(), lay.column(),
         lay.state(pp, nn), lay.column(), lay.state(pp, nn)],  # fmt: skip
        [lay.score_rows(), lay.column_tile(), lay.column_tile(), lay.tile_of(nn, heads=False),
         lay.tile_of(nn, heads=False), lay.row_partial(), lay.column_tile()],  # fmt: skip
        [jax.ShapeDtypeStruct(dcb_shape, F32), col_out, col_out, sum_out, sum_out,
         jax.ShapeDtypeStruct((b, h, c, tiles, 1, k), F32), col_out],  # fmt: skip
        interpret=interpret,
        num_warps=prep.sizes.num_warps_bwd,
        num_stages=prep.sizes.num_stages_bwd,
    )(
        prep.x, dy_l, prep.B, prep.C, cbt, cs_c, cs_r, dt_c, seq_c, seq_r, wst_c, dh_out, wout_c,
        h_in,
    )  # fmt: skip
    rowsum = rowsum_part.sum(axis=3)[..., 0, :]  # over source tiles
    # dCB summed over the head blocks of each group, then the intra-chunk dB and dC.
    dcb = dcb.reshape(b, c, g, blocks // g, k, k).sum(axis=3).astype(prep.mm_dtype)
    db_intra, dc_intra = prep.score_grads(dcb)

    # Decay gradient per position (see the module docstring for the terms), then a reverse
    # cumsum within each chunk gives d(dt * A).
    ddt_intra, v, u = (arr[..., 0] for arr in (ddt_intra, v, u))
    state_term = prep.w_state * prep.dt * v
    dcs = rowsum - prep.dt * ddt_intra + prep.w_out * u - state_term
    carry = prep.decay * carry_dots
    dcs = dcs.at[..., -1].add(jnp.sum(state_term, axis=-1) + carry)
    da = jnp.flip(jnp.cumsum(jnp.flip(dcs, -1), axis=-1), -1)
    ddt = ddt_intra + prep.w_state * v + da * prep.A[:, None, None]
    dA = jnp.einsum("bhck,bhck->h", da, prep.dt)
    ddt = jnp.moveaxis(ddt.reshape(b, h, c * k), 1, 2)[:, :l]

    def group_sum(arr):
        """Per-head-block (b, l', h / hb, n') sums summed over the blocks of each group."""
        arr = lay.from_seq_major(arr)[:, :l, :, :n]
        return arr.reshape(b, l, g, blocks // g, n).sum(axis=3)

    db = group_sum(db_state) + db_intra[:, :l, :, :n]
    dc = group_sum(dc_state) + dc_intra[:, :l, :, :n]

    dx = prep.crop(lay.from_seq_major(dx), p)
    dD = dd_part.sum(axis=(0, 2, 3, 4, 5))
    dh0 = dh0[:, :, :p, :n]
    return dx, ddt, dA, db, dc, dD, dh0
