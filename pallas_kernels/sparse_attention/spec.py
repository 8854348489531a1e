"""What a HAX sparse attention selects: one frozen, validated spec that every function takes.

The pattern, the key budget, the LSH buckets and the dilation cross every file of this folder
(the ops, the reference, the indexed path, the kernels' layout, the decode step and prefill); they
travel together as a `SparseSpec`, checked once when it is built, and are read back through its
derived properties (`components`, `keys_per_component`, `num_buckets`, `dilation`).
"""

import dataclasses

import jax
from jax.ad_checkpoint import checkpoint_name

COMPONENTS = ("sw", "sink", "dilated", "lsh", "ks", "full")
BINNINGS = ("sign", "argmax")
# Sign buckets are int32 bit sets: 2^h must fit.
MAX_SIGN_BITS = 30


# The name of what a sparse attention selects (the kernels' layout, a sequence shard's carried and
# published rows, the ranking loss's sampled candidates): a rematerialised block that saves it
# (`jax.checkpoint_policies.save_only_these_names(SELECTION, ...)`) redoes none of the buckets,
# sorts and top-ks behind it in its backward (a few int32 arrays of the sequence's length).
SELECTION = "sparse_selection"


def selected(tree):
    """`tree` with every array named SELECTION."""
    return jax.tree.map(lambda x: checkpoint_name(x, SELECTION), tree)


def check_positive_int(name, value):
    """ValueError naming `value` unless it is a positive int (bool excluded)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _parse(pattern):
    """The components of `pattern`; ValueError naming the pattern if it is bad."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"pattern must be a non-empty '+'-joined string, got {pattern!r}")
    comps = tuple(pattern.split("+"))
    for comp in comps:
        if comp not in COMPONENTS:
            raise ValueError(
                f"unknown component {comp!r} in pattern {pattern!r}; known: {COMPONENTS}"
            )
        if comps.count(comp) > 1:
            raise ValueError(f"component {comp!r} repeated in pattern {pattern!r}")
    if "full" in comps and len(comps) > 1:
        raise ValueError(f"'full' cannot be combined with other components: {pattern!r}")
    return comps


@dataclasses.dataclass(frozen=True)
class SparseSpec:
    """A '+'-joined pattern of components sharing num_keys keys per query (SPEC §1.3).

    Each component gets kc = num_keys // #components keys. hash_bits: h of the LSH projection
    (n, h), required by lsh; binning: "sign" (2^h buckets) or "argmax" (h buckets); max_len:
    required by dilated (dilation = max(1, max_len // kc)); official_code: the official PyTorch
    code's non-causal LSH centring and empty-row softmax (see ops.sparse_attention). Hashable:
    jit takes it as a static argument.
    """

    pattern: str
    num_keys: int
    hash_bits: int | None = None
    binning: str = "sign"
    max_len: int | None = None
    official_code: bool = False

    def __post_init__(self):
        """Check every field against the pattern; drop hash_bits / max_len it does not use."""
        comps = _parse(self.pattern)
        check_positive_int("num_keys", self.num_keys)
        if self.num_keys < len(comps):
            raise ValueError(
                f"num_keys = {self.num_keys} is smaller than the {len(comps)} components of "
                f"{self.pattern!r}"
            )
        if self.binning not in BINNINGS:
            raise ValueError(f"binning must be one of {BINNINGS}, got {self.binning!r}")
        if self.has("dilated"):
            if self.max_len is None:
                raise ValueError(f"max_len is required by 'dilated' in pattern {self.pattern!r}")
            check_positive_int("max_len", self.max_len)
        if self.has("lsh"):
            if self.hash_bits is None:
                raise ValueError(
                    f"hash_bits (h of hash_proj (n, h)) is required by 'lsh' in pattern "
                    f"{self.pattern!r}"
                )
            check_positive_int("hash_bits", self.hash_bits)
            if self.binning == "sign" and self.hash_bits > MAX_SIGN_BITS:
                raise ValueError(
                    f"sign binning takes at most {MAX_SIGN_BITS} hash bits, got hash_bits = "
                    f"{self.hash_bits}"
                )
        # A setting no component reads is dropped, so that specs of the same attention are equal
        # (one jit cache entry; a config's default max_len does not split it).
        if not self.has("dilated"):
            object.__setattr__(self, "max_len", None)
        if not self.has("lsh"):
            object.__setattr__(self, "hash_bits", None)

    @property
    def components(self) -> tuple[str, ...]:
        """The pattern's components, in the order written."""
        return tuple(self.pattern.split("+"))

    def has(self, comp: str) -> bool:
        """Whether the pattern holds component `comp`."""
        return comp in self.components

    @property
    def keys_per_component(self) -> int:
        """kc = num_keys // #components: each component's key budget."""
        return self.num_keys // len(self.components)

    @property
    def num_buckets(self) -> int:
        """LSH buckets: 2^h for sign binning, h for argmax binning."""
        return 2**self.hash_bits if self.binning == "sign" else self.hash_bits

    @property
    def dilation(self) -> int:
        """Stride of the dilated component: max(1, max_len // kc)."""
        return max(1, self.max_len // self.keys_per_component)
