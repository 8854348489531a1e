"""bench/sparse_components.py's per-component selection statistics, from the indexed selection,
against the same statistics counted on the dense reference masks of each component alone."""

import jax
import numpy as np
import pytest
from scripts import load_script

from hax_jax.model_config import SparseConfig
from pallas_kernels.sparse_attention.reference import sparse_attention_mask
from pallas_kernels.sparse_attention.spec import SparseSpec

sparse_components = load_script("bench/sparse_components.py", "bench_sparse_components")


def test_selection_stats_equal_the_reference_masks_counts():
    b, l, n, kc = 2, 64, 4, 4
    keys = jax.random.split(jax.random.key(0), 4)
    q, k = (jax.random.normal(key, (b, l, n)) for key in keys[:2])
    hash_proj = jax.random.normal(keys[2], (n, 2))
    scores = jax.random.normal(keys[3], (b, l))
    spec = SparseSpec("lsh+ks", 2 * kc, hash_bits=2)
    stats = sparse_components.selection_stats(spec, q, k, hash_proj, scores)

    lsh = np.asarray(
        sparse_attention_mask(q, k, spec=SparseSpec("lsh", kc, hash_bits=2), hash_proj=hash_proj)
    )
    ks = np.asarray(sparse_attention_mask(q, k, spec=SparseSpec("ks", kc), key_scores=scores))
    logits = np.where(lsh | ks, np.einsum("bin,bjn->bij", np.asarray(q), np.asarray(k)), -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    late = slice(l // 2, None)
    for name, mine, other in (("lsh", lsh, ks), ("ks", ks, lsh)):
        only = mine & ~other
        assert stats[name]["keys"] == pytest.approx(mine[:, late].sum(-1).mean())
        assert stats[name]["only_keys"] == pytest.approx(only[:, late].sum(-1).mean())
        assert stats[name]["mass_on_only"] == pytest.approx((p * only)[:, late].sum(-1).mean())
    assert 0 < stats["lsh"]["only_keys"] < stats["lsh"]["keys"]  # the two overlap, but not wholly


def test_a_narrowed_pattern_keeps_each_components_keys():
    hax = SparseConfig(pattern="lsh+ks", num_keys=64, hash_bits=8)
    for pattern in ("ks", "lsh"):
        narrow = sparse_components.narrowed(hax, pattern)
        assert narrow.spec.components == (pattern,)
        assert narrow.spec.keys_per_component == hax.spec.keys_per_component == 32
