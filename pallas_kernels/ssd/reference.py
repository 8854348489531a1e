"""Mamba-2 SSD, the definitions: the quadratic (attention-like) form and the plain recurrence.

Dao & Gu, "Transformers are SSMs" (arXiv:2405.21060): with a_t = dt_t * A the scalar-times-
identity SSM h_t = exp(a_t) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t equals Y = (L o C B^T) X
with L = exp(segsum(a)) (§3-4, Listing 1). Packed documents (seq_idx) cut L to a block
diagonal: no state crosses a change of seq_idx.
"""

import jax
import jax.numpy as jnp


def compute_dtype(*arrays):
    """Dtype the op runs in: at least fp32 (bf16 in -> fp32, fp64 stays fp64)."""
    return jnp.promote_types(jnp.result_type(*[a for a in arrays if a is not None]), jnp.float32)


def run_ids(seq_idx_bl):
    """Number the maximal runs of equal seq_idx in each row 0, 1, ... (nondecreasing)."""
    change_bl = seq_idx_bl[:, 1:] != seq_idx_bl[:, :-1]
    return jnp.pad(jnp.cumsum(change_bl, axis=1, dtype=jnp.int32), [(0, 0), (1, 0)])


def segsum(a_zl, same_zll=None):
    """Stable segment sum: out[..., i, j] = sum_{k=j+1..i} a[..., k] for i >= j, else -inf.

    Built by cumsum over a masked repeat (Listing 1 of arXiv:2405.21060), not as
    cumsum[i] - cumsum[j], which loses precision to cancellation. Entries where `same_zll` is
    False (pairs in different documents) are -inf too; the mask is applied with where before
    exp so exp gives exact zeros and zero gradients.
    """
    l = a_zl.shape[-1]
    a_zll = jnp.broadcast_to(a_zl[..., :, None], (*a_zl.shape, l))  # [..., k, j] = a_k
    below_ll = jnp.tril(jnp.ones((l, l), bool), k=-1)  # keep k > j
    ss_zll = jnp.cumsum(jnp.where(below_ll, a_zll, 0.0), axis=-2)
    keep_zll = jnp.tril(jnp.ones((l, l), bool))
    if same_zll is not None:
        keep_zll = keep_zll & same_zll
    return jnp.where(keep_zll, ss_zll, -jnp.inf)


def ssd_reference(
    x, dt, A, B, C, *, D=None, initial_state=None, return_final_state=False, seq_idx=None
):
    """SSD in its quadratic form Y = (L o C B^T) X; O(l^2), for testing only.

    Shapes: x (b, l, h, p); dt (b, l, h) positive; A (h,); B, C (b, l, g, n), head hh reads
    group hh // (h // g); D (h,); initial_state (b, h, p, n); seq_idx (b, l) int.
    seq_idx: each maximal run of equal values in a row is an independent sequence; the result
    equals running ssd on each run separately, with initial_state used only by the first run
    and the final state being the state at the end of the last run.
    Returns y (b, l, h, p) in x.dtype, and the final state (b, h, p, n) in the compute dtype.
    """
    dtype = compute_dtype(x, dt, A, B, C, D, initial_state)
    b, l, h, p = x.shape
    g, n = B.shape[2:]
    x_blhp, dt_blh = x.astype(dtype), dt.astype(dtype)
    B_blhn = jnp.repeat(B.astype(dtype), h // g, axis=2)
    C_blhn = jnp.repeat(C.astype(dtype), h // g, axis=2)
    h0_bhpn = jnp.zeros((b, h, p, n), dtype) if initial_state is None else initial_state
    h0_bhpn = h0_bhpn.astype(dtype)
    seq_bl = jnp.zeros((b, l), jnp.int32) if seq_idx is None else run_ids(seq_idx)

    # Treat the initial state as an input at a virtual position -1 (log-decay 0) that belongs
    # to the first document; one segsum then gives every decay we need.
    a_bhl = jnp.moveaxis(dt_blh * A.astype(dtype), 1, 2)
    a_bhm = jnp.pad(a_bhl, [(0, 0), (0, 0), (1, 0)])  # m = l + 1 positions
    seq_bm = jnp.concatenate([seq_bl[:, :1], seq_bl], axis=1)
    same_bmm = seq_bm[:, :, None] == seq_bm[:, None, :]
    L_bhmm = jnp.exp(segsum(a_bhm, same_bmm[:, None]))
    L_bhll = L_bhmm[:, :, 1:, 1:]  # position j -> position i
    init_to_out_bhl = L_bhmm[:, :, 1:, 0]  # initial state -> position i
    in_to_final_bhl = L_bhmm[:, :, -1, 1:]  # position j -> end of the row
    init_to_final_bh = L_bhmm[:, :, -1, 0]

    scores_bhll = jnp.einsum("bihn,bjhn->bhij", C_blhn, B_blhn) * L_bhll
    y_blhp = jnp.einsum("bhij,bjh,bjhp->bihp", scores_bhll, dt_blh, x_blhp)
    y_blhp += jnp.einsum("bhi,bihn,bhpn->bihp", init_to_out_bhl, C_blhn, h0_bhpn)
    if D is not None:
        y_blhp += D.astype(dtype)[:, None] * x_blhp
    y_blhp = y_blhp.astype(x.dtype)
    if not return_final_state:
        return y_blhp
    final_bhpn = jnp.einsum("bhj,bjh,bjhp,bjhn->bhpn", in_to_final_bhl, dt_blh, x_blhp, B_blhn)
    final_bhpn += init_to_final_bh[:, :, None, None] * h0_bhpn
    return y_blhp, final_bhpn


def ssd_sequential(
    x, dt, A, B, C, *, D=None, initial_state=None, return_final_state=False, seq_idx=None
):
    """SSD as the plain recurrence, one lax.scan step per position; same contract as above.

        h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,   y_t = h_t C_t + D x_t,
    with h_{t-1} replaced by 0 where seq_idx changes between t-1 and t.
    """
    dtype = compute_dtype(x, dt, A, B, C, D, initial_state)
    b, l, h, p = x.shape
    g, n = B.shape[2:]
    x_blhp, dt_blh = x.astype(dtype), dt.astype(dtype)
    B_blhn = jnp.repeat(B.astype(dtype), h // g, axis=2)
    C_blhn = jnp.repeat(C.astype(dtype), h // g, axis=2)
    h0_bhpn = jnp.zeros((b, h, p, n), dtype) if initial_state is None else initial_state
    seq_bl = jnp.zeros((b, l), jnp.int32) if seq_idx is None else run_ids(seq_idx)
    new_doc_bl = jnp.pad(seq_bl[:, 1:] != seq_bl[:, :-1], [(0, 0), (1, 0)])
    A_h = A.astype(dtype)

    def step(h_bhpn, inputs):
        """Advance every head by one position and read out y_t."""
        x_bhp, dt_bh, B_bhn, C_bhn, new_doc_b = inputs
        decay_bh = jnp.where(new_doc_b[:, None], 0.0, jnp.exp(dt_bh * A_h))
        h_bhpn = decay_bh[:, :, None, None] * h_bhpn + jnp.einsum(
            "bh,bhp,bhn->bhpn", dt_bh, x_bhp, B_bhn
        )
        return h_bhpn, jnp.einsum("bhpn,bhn->bhp", h_bhpn, C_bhn)

    xs = tuple(jnp.moveaxis(v, 1, 0) for v in (x_blhp, dt_blh, B_blhn, C_blhn, new_doc_bl))
    final_bhpn, y_lbhp = jax.lax.scan(step, h0_bhpn.astype(dtype), xs)
    y_blhp = jnp.moveaxis(y_lbhp, 0, 1)
    if D is not None:
        y_blhp += D.astype(dtype)[:, None] * x_blhp
    y_blhp = y_blhp.astype(x.dtype)
    return (y_blhp, final_bhpn) if return_final_state else y_blhp
