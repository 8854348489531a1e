"""The HAX paper's LSH bucketing, transcribed in numpy from its formulas, against our default path.

`paper_buckets` imports nothing of ours: it follows HAX §2.2 (arXiv:2507.00449), made causal as
SPEC §1.3 asks (q~_i = q_i - mean_{p<=i} q_p, eq. 5 with a running mean), in float64 with an
explicit loop over positions:
  eq. 5  x~_i = normalize(x_i - m_i),   m_i = (x_0 + ... + x_i) / (i + 1)
  eq. 6  argmax binning:  bin_i = argmax_j (x~_i H)_j                      (h buckets)
  eq. 7  sign binning:    bin_i = sum_{j=1..h} [(x~_i H)_j > 0] 2^(h - j)  (2^h buckets)
Normalising multiplies a row of x~ H by a positive number, so it changes no sign and no argmax.

Two conventions are ours, not the paper's, and the tests pin both:
- Bit order. Eq. 7 makes column 1 the most significant bit; the library (and the official code, as
  transcribed in test_sparse_attention.py) gives column t (from 0) the weight 2^t. Bucket ids are
  only ever compared with each other, so the two numberings select the same keys; the ids are
  checked through `reverse_bits`.
- Rounding noise at zero. A centred vector that is zero in exact arithmetic (the first token; a run
  of identical leading tokens) comes out of fp32 as noise of arbitrary sign. A projection
  |(x_i - m_i) H_t| <= NOISE_RTOL (|x_i| + |m_i|) |H_t| therefore counts as exactly zero: no bit,
  and argmax over all-zero projections is column 0 (the first maximum). The tolerance is the one
  documented in reference.py; it is written out here, not imported.

The oracle sees exact zeros where the library sees noise (float64 holds the mean of a few
identical fp32 rows exactly), so the zero-run test pins the library's side of the rule and the
near-floor test (a projection put at 1/4 and at 4 times the floor) pins the rule itself.
`assert_well_posed` checks that no decision of the oracle sits so close to the floor or to an
argmax tie that fp32 rounding in the library could flip it, so every mismatch is a real one.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sparse_attention import sparse_attention
from pallas_kernels.sparse_attention.reference import running_buckets

NOISE_RTOL = 1e-5  # reference.py's rule for rounding noise at zero, transcribed
B_, N_ = 2, 8
SHAPES = [(l, h) for l in (1, 17, 64) for h in (3, 8)]
SEEDS = (1, 2, 3)


def _projections(x, hash_proj):
    """(x_i - m_i) H (b, l, h) in float64 with the causal running mean m_i, and its noise floor."""
    x = np.asarray(x, np.float64)
    hash_proj = np.asarray(hash_proj, np.float64)
    mean = np.empty_like(x)
    for i in range(x.shape[1]):
        mean[:, i] = x[:, : i + 1].mean(axis=1)  # only positions 0..i: causal
    centred = x - mean
    proj = centred @ hash_proj
    scale = np.linalg.norm(x, axis=-1) + np.linalg.norm(mean, axis=-1)
    tol = NOISE_RTOL * scale[..., None] * np.linalg.norm(hash_proj, axis=0)
    return centred, proj, tol


def paper_buckets(x, hash_proj, binning):
    """HAX eqs. 5-7 (causal mean; eq. 7's bit order): bucket ids (b, l) of x (b, l, n), H (n, h)."""
    centred, proj, tol = _projections(x, hash_proj)
    norm = np.linalg.norm(centred, axis=-1, keepdims=True)
    # eq. 5's normalize, then projections within the noise floor count as exactly zero.
    proj = np.where(np.abs(proj) <= tol, 0.0, proj / np.where(norm > 0, norm, 1.0))
    if binning == "argmax":
        return proj.argmax(-1)  # eq. 6; ties (all zero) go to the first column
    h = proj.shape[-1]
    weights = 2 ** (h - 1 - np.arange(h))  # eq. 7: column j = 1..h weighs 2^(h - j)
    return ((proj > 0) * weights).sum(-1)


def reverse_bits(ids, h):
    """Bucket ids with their h bits in the opposite order (eq. 7's numbering <-> the library's)."""
    bits = (np.asarray(ids)[..., None] >> np.arange(h)) & 1
    return (bits * 2 ** np.arange(h)[::-1]).sum(-1)


def assert_well_posed(x, hash_proj):
    """No projection near the noise floor and no near-tie for the argmax: fp32 cannot flip them."""
    centred, proj, tol = _projections(x, hash_proj)
    near_floor = (np.abs(proj) > tol / 2) & (np.abs(proj) < 2 * tol)
    assert not near_floor.any(), "a projection is within 2x of the noise floor: pick other inputs"
    kept = np.sort(np.where(np.abs(proj) <= tol, 0.0, proj), axis=-1)
    if proj.shape[-1] > 1:
        gap = kept[..., -1] - kept[..., -2]
        floor = 1e-4 * np.linalg.norm(centred, axis=-1) * np.linalg.norm(hash_proj, axis=0).max()
        assert not ((gap > 0) & (gap < floor)).any(), "an argmax near-tie: pick other inputs"


def make_inputs(l, h, seed):
    """Random fp32 x (B_, l, N_) and hash projection (N_, h)."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((B_, l, N_), np.float32), rng.standard_normal((N_, h), np.float32)


def check_running_buckets(x, hash_proj, binning):
    """running_buckets(x) equals the paper's buckets (through reverse_bits for sign binning)."""
    assert_well_posed(x, hash_proj)
    got = np.asarray(running_buckets(jnp.asarray(x), jnp.asarray(hash_proj), binning))
    want = paper_buckets(x, hash_proj, binning)
    if binning == "sign":
        want = reverse_bits(want, hash_proj.shape[1])
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("binning", ["sign", "argmax"])
@pytest.mark.parametrize("l, h", SHAPES)
@pytest.mark.parametrize("seed", SEEDS)
def test_running_buckets_equal_the_paper(binning, l, h, seed):
    x, hash_proj = make_inputs(l, h, seed)
    check_running_buckets(x, hash_proj, binning)
    # The first token centres to zero: no sign bit, argmax column 0.
    np.testing.assert_array_equal(paper_buckets(x, hash_proj, binning)[:, 0], 0)
    if l > 1:  # the other buckets vary, so the comparison is not between constants
        assert len(np.unique(paper_buckets(x, hash_proj, binning))) > 1


@pytest.mark.parametrize("binning", ["sign", "argmax"])
@pytest.mark.parametrize("h", [3, 8])
def test_zero_centred_runs_equal_the_paper(binning, h):
    """A run of identical leading tokens equals its running mean: bucket 0 in both, although
    fp32 leaves noise there; after the run the buckets vary again. A constant sequence is all
    bucket 0."""
    x, hash_proj = make_inputs(40, h, seed=5)
    x[:, 1:9] = x[:, :1]
    check_running_buckets(x, hash_proj, binning)
    buckets = paper_buckets(x, hash_proj, binning)
    np.testing.assert_array_equal(buckets[:, :9], 0)
    assert (buckets[:, 9:] != 0).any()
    constant = np.broadcast_to(x[:, :1], x.shape).copy()
    check_running_buckets(constant, hash_proj, binning)
    np.testing.assert_array_equal(paper_buckets(constant, hash_proj, binning), 0)


@pytest.mark.parametrize("binning", ["sign", "argmax"])
@pytest.mark.parametrize("direction", [1.0, -1.0])
@pytest.mark.parametrize("ratio", [0.25, 4.0])
def test_projections_near_the_noise_floor_equal_the_paper(binning, direction, ratio):
    """Token 1 = token 0 + delta * direction * H_0 / |H_0| with orthogonal columns of H: its
    centred vector projects only onto column 0, at `ratio` times the noise floor. Below the floor
    the projection counts as zero (bucket 0); above it, it sets bit 0 (sign, direction +1) or moves
    the argmax off a negative column 0 to column 1 (argmax, direction -1)."""
    h = 4
    rng = np.random.default_rng(7)
    hash_proj = np.linalg.qr(rng.standard_normal((N_, h)))[0] * rng.uniform(0.5, 2.0, h)
    hash_proj = hash_proj.astype(np.float32)
    x0 = rng.standard_normal((B_, N_))
    # x1 - m1 = delta / 2 * e and |x1| + |m1| ~ 2 |x0|: the ratio to the floor is
    # delta / (4e-5 |x0|).
    delta = ratio * 4 * NOISE_RTOL * np.linalg.norm(x0, axis=-1, keepdims=True)
    unit = hash_proj[:, 0] / np.linalg.norm(hash_proj[:, 0])
    x = np.stack([x0, x0 + delta * direction * unit], axis=1).astype(np.float32)
    _, proj, tol = _projections(x, hash_proj)
    np.testing.assert_allclose(np.abs(proj[:, 1, 0]) / tol[:, 1, 0], ratio, rtol=0.02)
    got = np.asarray(running_buckets(jnp.asarray(x), jnp.asarray(hash_proj), binning))
    want = paper_buckets(x, hash_proj, binning)
    if binning == "sign":
        want = reverse_bits(want, h)
    np.testing.assert_array_equal(got, want)
    above = ratio > 1
    by_hand = int(above and direction > 0) if binning == "sign" else int(above and direction < 0)
    np.testing.assert_array_equal(got, [[0, by_hand]] * B_)


def paper_selection(bucket_q, bucket_k, kc):
    """selected[b, i, j]: j is one of the kc most recent keys j <= i in query i's bucket."""
    b, l = bucket_q.shape
    selected = np.zeros((b, l, l), bool)
    for bb in range(b):
        for i in range(l):
            same = [j for j in range(i + 1) if bucket_k[bb, j] == bucket_q[bb, i]]
            selected[bb, i, same[-kc:]] = True
    return selected


@pytest.mark.parametrize("binning", ["sign", "argmax"])
@pytest.mark.parametrize("l, h", [(17, 3), (64, 4)])
@pytest.mark.parametrize("seed", [0, 1])
def test_indexed_attention_selects_by_the_paper_buckets(binning, l, h, seed):
    """With v = identity, o[b, i, j] > 0 exactly where query i attends to key j: the keys the
    indexed path selects are the kc most recent keys in the paper's bucket of the query."""
    kc = 3
    rng = np.random.default_rng(100 + seed)
    q, k = (rng.standard_normal((B_, l, N_), np.float32) for _ in range(2))
    hash_proj = rng.standard_normal((N_, h), np.float32)
    assert_well_posed(q, hash_proj)
    assert_well_posed(k, hash_proj)
    v = jnp.broadcast_to(jnp.eye(l, dtype=jnp.float32), (B_, l, l))
    o = sparse_attention(
        jnp.asarray(q),
        jnp.asarray(k),
        v,
        pattern="lsh",
        num_keys=kc,
        hash_proj=jnp.asarray(hash_proj),
        binning=binning,
        impl="indexed",
    )
    bucket_q, bucket_k = (paper_buckets(x, hash_proj, binning) for x in (q, k))
    want = paper_selection(bucket_q, bucket_k, kc)
    np.testing.assert_array_equal(np.asarray(o) > 0, want)
    unlimited = paper_selection(bucket_q, bucket_k, l)
    assert unlimited.sum() > want.sum()  # the window of kc drops keys
    assert (want.sum(-1) == 0).any()  # and some queries find no key in their bucket
