"""HAX context-dependent sparse attention (sw / sink / dilated / lsh / ks / full), with decode."""

from .decode import LinearScore, SparseAttentionCache
from .ops import (
    init_cache,
    prefill_cache,
    sparse_attention,
    sparse_attention_step,
)
from .reference import (
    lsh_buckets,
    official_lsh_inputs,
    running_mean,
    sparse_attention_mask,
    sparse_attention_reference,
)
from .spec import SparseSpec

__all__ = [
    "LinearScore",
    "SparseAttentionCache",
    "SparseSpec",
    "init_cache",
    "lsh_buckets",
    "official_lsh_inputs",
    "prefill_cache",
    "running_mean",
    "sparse_attention",
    "sparse_attention_mask",
    "sparse_attention_reference",
    "sparse_attention_step",
]
