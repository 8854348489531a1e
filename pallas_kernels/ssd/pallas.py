"""The Pallas SSD between ops.py and the kernels: the inputs padded and laid out once (Prepared),
the chunk kernels chained into the forward, and the backward assembled from the kernels' parts.
The algorithm and the letters: kernel.py's docstring."""

import jax
import jax.numpy as jnp

from . import kernel, kernel_mgpu
from .kernel import F32, call, chunk_outputs, chunk_states
from .reference import run_ids
from .state_passing import pass_state_grads, pass_states
from .tiling import Layout


def _round_up_pow2(n, minimum):
    """The next power of two >= max(n, minimum)."""
    return max(minimum, 1 << max(0, (n - 1).bit_length()))


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
        self.layout = Layout(variant, k, sizes.tile, h // g)
        self.grad_layout = Layout(variant, k, sizes.tile_bwd, h // g, sizes.heads_per_block)
        self.dx_layout = Layout(variant, k, sizes.tile_bwd, h // g)

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


def pad_state(prep, state_bhpn):
    """A (b, h, p, n) state in fp32, zero-padded to (p', n')."""
    _, _, _, p, _, n = prep.shape
    if state_bhpn is None:
        b, _, h, *_ = prep.shape
        return jnp.zeros((b, h, prep.p_pad, prep.n_pad), F32)
    widths = [(0, 0), (0, 0), (0, prep.p_pad - p), (0, prep.n_pad - n)]
    return jnp.pad(state_bhpn.astype(F32), widths)


def _chunk_kernels(prep, interpret):
    """(chunk_states, chunk_outputs): the Mosaic GPU twins where `kernel_mgpu.use_mosaic_gpu`
    says (Hopper, measured faster), else the Triton / Mosaic TPU ones of kernel.py."""
    if kernel_mgpu.use_mosaic_gpu(prep, prep.sizes.mosaic_gpu, interpret):
        return kernel_mgpu.chunk_states_mgpu, kernel_mgpu.chunk_outputs_mgpu
    return chunk_states, chunk_outputs


def forward(
    x, dt, A, B, C, D, initial_state, seq_idx, *, chunk_size, variant, sizes, interpret=None
):
    """(y (b, l, h, p) in x.dtype, final state (b, h, p, n) fp32, residuals for backward);
    `sizes` are resolved BlockSizes."""
    prep, S = forward_states(
        x,
        dt,
        A,
        B,
        C,
        D,
        seq_idx,
        chunk_size=chunk_size,
        variant=variant,
        sizes=sizes,
        interpret=interpret,
    )
    return forward_from_states(prep, S, initial_state, interpret)


def forward_states(x, dt, A, B, C, D, seq_idx, *, chunk_size, variant, sizes, interpret=None):
    """(Prepared inputs, chunk states S (b, c, h, p', n') fp32): forward's first stage, which
    no initial state enters."""
    prep = Prepared(x, dt, A, B, C, D, seq_idx, chunk_size, variant, sizes)
    states, _ = _chunk_kernels(prep, interpret)
    return prep, states(prep, prep.x, prep.w_state * prep.dt, prep.B, interpret=interpret)


def forward_from_states(prep, S, initial_state, interpret=None):
    """forward's (y, final state, residual H_in) from its chunk states and an initial state."""
    _, outputs = _chunk_kernels(prep, interpret)
    h_in, final = pass_states(prep, S, pad_state(prep, initial_state), interpret)
    y = outputs(prep, h_in, interpret=interpret)
    _, _, _, p, _, n = prep.shape
    y = prep.crop(prep.layout.from_seq_major(y), p)
    return y, final[:, :, :p, :n], h_in


def _decay_products(prep):
    """(before, after) (b, h, c) fp32: the products of the chunk decays before and after chunk c,
    i.e. what of the initial state enters chunk c, and what of S_c is left after the last chunk
    (zero across a change of document)."""
    ones = jnp.ones_like(prep.decay[..., :1])
    before = jnp.cumprod(jnp.concatenate([ones, prep.decay[..., :-1]], axis=-1), axis=-1)
    reverse = jnp.concatenate([ones, jnp.flip(prep.decay, -1)[..., :-1]], axis=-1)
    return before, jnp.flip(jnp.cumprod(reverse, axis=-1), -1)


def _weigh_chunks(weight_bhc, prep, arr_bchpn):
    """sum_c weight[c] arr[c], cropped to (b, h, p, n) fp32. A product and a sum over the chunk
    axis, read in place: as a dot (heads its batch axis, chunks its contraction) XLA first
    copied the states into a heads-major layout, tripling the traffic of this 50 MB read a
    block at 16K tokens."""
    _, _, _, p, _, n = prep.shape
    weight_bchpn = jnp.moveaxis(weight_bhc, 2, 1)[..., None, None]
    out = jnp.sum(weight_bchpn * arr_bchpn.astype(F32), axis=1)
    return out[:, :, :p, :n]


def zero_start_final(prep, S):
    """The final state from a zero initial state, from the chunk states: sum_c after[c] S_c."""
    return _weigh_chunks(_decay_products(prep)[1], prep, S)


def backward(
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
    *,
    chunk_size,
    variant,
    sizes,
    interpret=None,
):
    """Gradients (dx, ddt, dA, dB, dC, dD, d initial_state) of forward's (y, final state)."""
    prep, dy_l, dS = backward_states(
        x,
        dt,
        A,
        B,
        C,
        D,
        seq_idx,
        dy,
        chunk_size=chunk_size,
        variant=variant,
        sizes=sizes,
        interpret=interpret,
    )
    return backward_from_states(prep, dy_l, dS, dfinal, h_in, interpret)


def backward_states(x, dt, A, B, C, D, seq_idx, dy, *, chunk_size, variant, sizes, interpret=None):
    """(Prepared inputs, dy in the kernels' layout, dS (b, c, h, p', n') fp32: what y asks of
    the state entering each chunk): backward's first stage, which no final state's gradient
    enters."""
    prep = Prepared(x, dt, A, B, C, D, seq_idx, chunk_size, variant, sizes)
    _, l, _, p, _, _ = prep.shape
    widths = [(0, 0), (0, prep.c * prep.k - l), (0, 0), (0, prep.p_pad - p)]
    dy_l = prep.layout.seq_major(jnp.pad(dy.astype(prep.mm_dtype), widths))
    states, _ = _chunk_kernels(prep, interpret)
    return prep, dy_l, states(prep, dy_l, prep.w_out, prep.C, interpret=interpret)


def initial_state_grad_from_outputs(prep, dS):
    """d y / d initial state alone (no final state's gradient): sum_c before[c] dS_c."""
    return _weigh_chunks(_decay_products(prep)[0], prep, dS)


def backward_from_states(prep, dy_l, dS, dfinal, h_in, interpret=None):
    """backward's gradients from its first stage, the final state's gradient and the forward's
    H_in: the reverse scan of the state gradients over chunks, then the gradient kernels."""
    b, l, h, p, g, n = prep.shape
    pp, nn, c, k = prep.p_pad, prep.n_pad, prep.c, prep.k
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
    dx, dd_part = call(
        kernel.grad_dx_kernel,
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
            jax.ShapeDtypeStruct(prep.x.shape, prep.out_dtype),
            jax.ShapeDtypeStruct((b, h, c, k // one.tile, 1, 1), F32),
        ],
        interpret=interpret,
        num_warps=prep.sizes.num_warps_bwd,
        num_stages=prep.sizes.num_stages_bwd,
    )(
        dy_l,
        prep.x,
        prep.B,
        cbt,
        cs_c,
        cs_r,
        dt_c,
        seq_c,
        seq_r,
        wst_c,
        dh_out,
        prep.D[:, None, None],
    )
    dcb_shape = (b, c, blocks, k, k)
    dcb, ddt_intra, v, db_state, dc_state, rowsum_part, u = call(
        kernel.grad_bc_kernel,
        lay,
        grid,
        [
            lay.chunk(pp),
            lay.chunk(pp),
            lay.group_chunk(nn),
            lay.group_chunk(nn),
            lay.scores(),
            lay.column(),
            lay.row(),
            lay.column(),
            lay.seq_column(),
            lay.seq_row(),
            lay.column(),
            lay.state(pp, nn),
            lay.column(),
            lay.state(pp, nn),
        ],
        [
            lay.score_rows(),
            lay.column_tile(),
            lay.column_tile(),
            lay.tile_of(nn, heads=False),
            lay.tile_of(nn, heads=False),
            lay.row_partial(),
            lay.column_tile(),
        ],
        [
            jax.ShapeDtypeStruct(dcb_shape, F32),
            col_out,
            col_out,
            sum_out,
            sum_out,
            jax.ShapeDtypeStruct((b, h, c, tiles, 1, k), F32),
            col_out,
        ],
        interpret=interpret,
        num_warps=prep.sizes.num_warps_bwd,
        num_stages=prep.sizes.num_stages_bwd,
    )(
        prep.x,
        dy_l,
        prep.B,
        prep.C,
        cbt,
        cs_c,
        cs_r,
        dt_c,
        seq_c,
        seq_r,
        wst_c,
        dh_out,
        wout_c,
        h_in,
    )
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
