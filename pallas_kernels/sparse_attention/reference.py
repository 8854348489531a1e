"""HAX context-dependent sparse attention, the definitions: one dense (b, l, l) mask per component.

Paper: "Overcoming Long-Context Limitations of SSMs via Context-Dependent Sparse Attention"
(arXiv:2507.00449), §2.2 and §4. Query i attends to the union of the key sets chosen by the
components of a '+'-joined pattern; each component gets kc = num_keys // (#components) keys:
  sw       i - j < kc (sliding window)
  sink     j < kc (attention sinks)
  dilated  the kc most recent j <= i with j % d == d - 1, d = max(1, max_len // kc)
  lsh      the kc most recent j <= i whose key bucket equals the query bucket; buckets hash the
           running-mean-centred q / k with a random projection (sign bits or argmax)
  ks       the top-kc keys among key_scores[0..i], ties going to the earlier position; a key
           scored -inf is never selected (it marks an empty row)
  full     every j <= i (dense causal attention)
Softmax runs over the selected keys only; a query with no selected key outputs 0.

Everything here is O(l^2) and exists to define the op and to test the fast path against it;
`sparse_attention_reference` under `spec.official_code` is also the (dense by design)
transcription of the official PyTorch code's non-causal behaviours.

Letters: b batch, i query position, j / p key position, n key dim, e value dim, h hash bits.
"""

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST


def running_mean(x_bln):
    """Causal running mean over the sequence axis, in fp32: out[:, i] = mean(x[:, :i + 1])."""
    x_bln = x_bln.astype(jnp.float32)
    count_l = jnp.arange(1, x_bln.shape[1] + 1, dtype=jnp.float32)
    return jnp.cumsum(x_bln, axis=1) / count_l[:, None]


# A centred vector that is zero in exact arithmetic (the first position; a query equal to its
# running mean, as in a run of identical tokens) comes out as rounding noise, and the sign of
# noise is arbitrary: it differs between the parallel and the decode computation. Projections
# within this relative tolerance of zero therefore count as zero (not positive; argmax -> 0).
NOISE_RTOL = 1e-5


def centred(x_bln, mean_bln):
    """(x - mean, |x| + |mean|): the LSH input and the scale its rounding noise is relative to."""
    x_bln, mean_bln = x_bln.astype(jnp.float32), mean_bln.astype(jnp.float32)
    scale_bl = jnp.linalg.norm(x_bln, axis=-1) + jnp.linalg.norm(mean_bln, axis=-1)
    return x_bln - mean_bln, scale_bl


def lsh_buckets(x_zn, hash_proj_nh, binning, scale_z=None):
    """Bucket ids (int32) of already-centred vectors x (..., n) under the projection H (n, h).

    sign: sum_t [(x H)_t > 0] 2^t (2^h buckets); argmax: argmax_t (x H)_t (h buckets). With
    `scale_z` (...,) (see `centred`), projections below NOISE_RTOL * scale * |H_t| are zero. No
    gradient flows through a bucket id.
    """
    x_zn = jax.lax.stop_gradient(x_zn.astype(jnp.float32))
    hash_proj_nh = hash_proj_nh.astype(jnp.float32)
    proj_zh = jnp.einsum("...n,nh->...h", x_zn, hash_proj_nh, precision=HIGHEST)
    if scale_z is not None:
        tol_zh = (
            NOISE_RTOL
            * jax.lax.stop_gradient(scale_z)[..., None]
            * jnp.linalg.norm(hash_proj_nh, axis=0)
        )
        proj_zh = jnp.where(jnp.abs(proj_zh) <= tol_zh, 0.0, proj_zh)
    if binning == "argmax":
        return jnp.argmax(proj_zh, axis=-1).astype(jnp.int32)
    bits_h = jnp.left_shift(1, jnp.arange(proj_zh.shape[-1], dtype=jnp.int32))
    return jnp.sum(jnp.where(proj_zh > 0, bits_h, 0), axis=-1, dtype=jnp.int32)


def running_buckets(x_bln, hash_proj_nh, binning):
    """Buckets of x centred by its causal running mean (paper eqs. 5-7, made causal)."""
    x_c_bln, scale_bl = centred(x_bln, running_mean(x_bln))
    return lsh_buckets(x_c_bln, hash_proj_nh, binning, scale_bl)


def official_lsh_inputs(x_bln):
    """The official code's hash input: centre by the whole-sequence mean, then L2-normalise each
    feature over the sequence axis (torch `F.normalize(x)` on (b, l, n), dim=1, eps=1e-12)."""
    x_bln = x_bln.astype(jnp.float32)
    x_bln = x_bln - jnp.mean(x_bln, axis=1, keepdims=True)
    norm_b1n = jnp.sqrt(jnp.sum(x_bln * x_bln, axis=1, keepdims=True))
    return x_bln / jnp.maximum(norm_b1n, 1e-12)


def _most_recent(match_bij, kc):
    """Keep, in each row, the kc largest j with match[i, j] (match must already be causal)."""
    # Matches at or after j (and <= i, as match is causal): a reversed cumsum along j.
    rank_bij = jnp.flip(jnp.cumsum(jnp.flip(match_bij, -1), axis=-1, dtype=jnp.int32), -1)
    return match_bij & (rank_bij <= kc)


def _top_scores(key_scores_bl, kc, causal_ij):
    """keep[i, j]: j <= i, s_j > -inf and fewer than kc keys p <= i beat j (higher score, or
    equal score at an earlier position)."""
    s_bl = jax.lax.stop_gradient(key_scores_bl.astype(jnp.float32))
    l = s_bl.shape[1]
    pos_l = jnp.arange(l)
    s_bp1, s_b1j = s_bl[:, :, None], s_bl[:, None, :]
    beats_bpj = (s_bp1 > s_b1j) | ((s_bp1 == s_b1j) & (pos_l[:, None] < pos_l[None, :]))
    ahead_bij = jnp.cumsum(beats_bpj, axis=1, dtype=jnp.int32)  # over p <= i
    return causal_ij & (ahead_bij < kc) & (s_b1j > -jnp.inf)


def sparse_attention_mask(q, k, *, spec, hash_proj=None, key_scores=None):
    """The (b, l, l) boolean mask mask[b, i, j] = query i attends to key j (union of components).

    spec.official_code hashes like the official code (`official_lsh_inputs`); every other
    component is the same.
    """
    b, l, _ = q.shape
    kc = spec.keys_per_component
    pos_l = jnp.arange(l)
    i_l1, j_1l = pos_l[:, None], pos_l[None, :]
    causal_ij = j_1l <= i_l1
    mask_bij = jnp.zeros((b, l, l), bool)
    for comp in spec.components:
        if comp == "full":
            keep = causal_ij
        elif comp == "sw":
            keep = causal_ij & (i_l1 - j_1l < kc)
        elif comp == "sink":
            keep = causal_ij & (j_1l < kc)
        elif comp == "dilated":
            d = spec.dilation
            keep = _most_recent(jnp.broadcast_to(causal_ij & (j_1l % d == d - 1), (l, l)), kc)
        elif comp == "lsh":
            if spec.official_code:
                q_in, k_in = official_lsh_inputs(q), official_lsh_inputs(k)
                bucket_q_bl = lsh_buckets(q_in, hash_proj, spec.binning)
                bucket_k_bl = lsh_buckets(k_in, hash_proj, spec.binning)
            else:
                bucket_q_bl = running_buckets(q, hash_proj, spec.binning)
                bucket_k_bl = running_buckets(k, hash_proj, spec.binning)
            same_bij = bucket_q_bl[:, :, None] == bucket_k_bl[:, None, :]
            keep = _most_recent(causal_ij & same_bij, kc)
        else:  # ks
            keep = _top_scores(key_scores, kc, causal_ij)
        mask_bij = mask_bij | keep
    return mask_bij


def sparse_attention_reference(q, k, v, *, spec, hash_proj=None, key_scores=None):
    """Dense masked-softmax attention over `sparse_attention_mask`; O(l^2), the test oracle.

    q, k (b, l, n); v (b, l, e); logits q_i . k_j (k already scaled); fp32 compute, output
    (b, l, e) in v.dtype. Rows with no selected key output 0 (and get zero gradient); with
    spec.official_code they instead get the official code's softmax over an additive finfo.min
    mask, which is uniform over all l positions (future included).
    """
    mask_bij = sparse_attention_mask(q, k, spec=spec, hash_proj=hash_proj, key_scores=key_scores)
    q_bin, k_bjn, v_bje = (x.astype(jnp.float32) for x in (q, k, v))
    scores_bij = jnp.einsum("bin,bjn->bij", q_bin, k_bjn)
    if spec.official_code:
        bias_bij = jnp.where(mask_bij, 0.0, jnp.finfo(jnp.float32).min)
        probs_bij = jax.nn.softmax(scores_bij + bias_bij, axis=-1)
        return jnp.einsum("bij,bje->bie", probs_bij, v_bje).astype(v.dtype)
    # Masked entries are made finite before exp so they carry exact zeros, not NaN gradients.
    scores_bij = jnp.where(mask_bij, scores_bij, 0.0)
    max_bi1 = jnp.max(jnp.where(mask_bij, scores_bij, -jnp.inf), axis=-1, keepdims=True)
    max_bi1 = jax.lax.stop_gradient(jnp.where(jnp.isfinite(max_bi1), max_bi1, 0.0))
    weights_bij = jnp.where(mask_bij, jnp.exp(scores_bij - max_bi1), 0.0)
    denom_bi1 = jnp.sum(weights_bij, axis=-1, keepdims=True)
    o_bie = jnp.einsum("bij,bje->bie", weights_bij, v_bje)
    return (o_bie / jnp.where(denom_bi1 > 0, denom_bi1, 1.0)).astype(v.dtype)
