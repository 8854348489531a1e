"""Multi-query joint recall (HAX paper §3.2), with the token layout of the HAX code's generator.

Tokens: bos 1, pad 3, sep 4, values 10.., keys 10 + n_value.., contexts 10 + n_value + max_n_key..
(with the defaults: values 10..25, keys 26..41, contexts 42..57, vocab 100). A sequence is bos, then
every context (in a random order) followed by all its key-value pairs (keys in a random order), sep,
then the inquiry part: the contexts and keys re-permuted, each key followed by its value; padded to
(2 max_n_context)(2 max_n_key + 1) + 2 (1058). The loss and the accuracy are taken at the inquiry
keys, predicting the value that follows.

Multi-level contexts (HAX paper App. C): `outer_levels=(a, b, ...)` puts a fixed number of blocks of
each extra level above the contexts (outermost first); every block starts with its own level's
token, levels' token ranges follow the contexts' (a tokens, then b, ...), the table has shape (a, b,
..., n_context, n_key), and the inquiry part re-permutes every level. The keys are the last context
level; every entry is asked.
"""

import functools
import hashlib
import itertools
import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from hax_jax.data import pcg64, split_cache

BOS, PAD, SEP = 1, 3, 4
LAST = (1 << 63) - 1  # a sort key above every 63-bit word: padding children sort last
VALUE_OFFSET = 10
SPLITS = {
    "train": (0, 980),
    "valid": (980, 990),
    "test": (990, 1000),
}  # example-hash ranges out of 1000


def padded_length(max_n_context: int, max_n_key: int, outer_levels: tuple[int, ...] = ()) -> int:
    """The HAX code's fixed sequence length: both parts of the largest table, plus bos and sep."""
    part = 2 * max_n_key  # a context's key-value pairs
    for size in (max_n_context, *reversed(outer_levels)):
        part = size * (1 + part)  # each block is its level's token and its children
    return 2 * part + 2


def level_bases(
    n_value: int, max_n_context: int, max_n_key: int, outer_levels: tuple[int, ...] = ()
) -> tuple[int, ...]:
    """The first token id of every level, outermost first: (*outer levels, contexts, keys)."""
    key_base = VALUE_OFFSET + n_value
    context_base = key_base + max_n_key
    outer_bases = itertools.accumulate(outer_levels, initial=context_base + max_n_context)
    return (*list(outer_bases)[:-1], context_base, key_base)


def check_vocab(
    vocab_size: int,
    n_value: int = 16,
    max_n_context: int = 16,
    max_n_key: int = 16,
    outer_levels: tuple[int, ...] = (),
) -> None:
    """Raises ValueError when the largest token id of this layout is not below vocab_size."""
    top = VALUE_OFFSET + n_value + max_n_key + max_n_context + sum(outer_levels) - 1
    if top >= vocab_size:
        raise ValueError(
            f"joint recall tokens reach {top} with n_value={n_value}, "
            f"max_n_context={max_n_context}, max_n_key={max_n_key}, "
            f"outer_levels={tuple(outer_levels)}; vocab_size={vocab_size} is too small"
        )


def layout(
    table,
    context_order,
    key_orders,
    inquiry_context_order,
    inquiry_key_orders,
    *,
    n_value=16,
    max_n_context=16,
    max_n_key=16,
):
    """Tokens and inquiry mask (int32 arrays of padded_length) of one two-level example.

    Args:
      table: (n_context, n_key) ints in [0, n_value): the value of key k in context c.
      context_order, inquiry_context_order: permutations of the contexts (information / inquiry).
      key_orders, inquiry_key_orders: per context (indexed by context id), a permutation of its
        keys.
    """
    return layout_levels(
        table,
        [context_order, key_orders],
        [inquiry_context_order, inquiry_key_orders],
        n_value=n_value,
        max_n_context=max_n_context,
        max_n_key=max_n_key,
    )


def layout_levels(
    table,
    orders,
    inquiry_orders,
    *,
    n_value=16,
    max_n_context=16,
    max_n_key=16,
    outer_levels=(),
):
    """Tokens and inquiry mask (int32 arrays of padded_length) of one multi-level example.

    Args:
      table: (*outer_levels, n_context, n_key) ints in [0, n_value): the value of every leaf.
      orders, inquiry_orders: one array per level (information / inquiry part); level d's has shape
        table.shape[:d + 1], and its entry at a parent's index path orders that parent's children.
    """
    table = np.asarray(table)
    outer_levels = tuple(outer_levels)
    n_context, n_key = table.shape[-2:] if table.ndim >= 2 else (0, 0)
    if not (
        table.shape[:-2] == outer_levels
        and 1 <= n_context <= max_n_context
        and 1 <= n_key <= max_n_key
    ):
        raise ValueError(
            f"table shape {table.shape} must be (*outer_levels={outer_levels}, n_context, n_key) "
            f"within (max_n_context={max_n_context}, max_n_key={max_n_key})"
        )
    bases = level_bases(n_value, max_n_context, max_n_key, outer_levels)
    tokens, mask = [BOS], [0]
    for part, part_orders in enumerate((orders, inquiry_orders)):
        if part == 1:
            tokens.append(SEP)
            mask.append(0)
        # Nested Python lists: per-token numpy scalar indexing would dominate the cost.
        part_orders = [np.asarray(o).tolist() for o in part_orders]
        _emit(table.tolist(), part_orders, bases, part, tokens, mask)
    length = padded_length(max_n_context, max_n_key, outer_levels)
    tokens += [PAD] * (length - len(tokens))
    mask += [0] * (length - len(mask))
    return np.asarray(tokens, np.int32), np.asarray(mask, np.int32)


def _emit(table, orders, bases, part, tokens, mask):
    """Appends a node's child blocks in order, recursively (table, orders: the node's parts)."""
    for child in orders[0]:
        tokens.append(bases[0] + child)
        if len(orders) == 1:  # a key: in the inquiry part, it predicts the value after it
            tokens.append(VALUE_OFFSET + table[child])
            mask += [part, 0]
        else:
            mask.append(0)
            _emit(table[child], [o[child] for o in orders[1:]], bases[1:], part, tokens, mask)


def draw_count(max_shape: tuple[int, ...]) -> int:
    """The number of random words one attempt draws: its two sizes, a table, every level's keys."""
    levels = sum(math.prod(max_shape[: d + 1]) for d in range(len(max_shape)))
    return 2 + math.prod(max_shape) + 2 * levels


def draw(
    seeds,
    *,
    n_context=(5, 16),
    n_key=(5, 16),
    n_value=16,
    max_n_context=16,
    max_n_key=16,
    outer_levels=(),
):
    """The random parts of a batch of attempts, attempt a a pure function of seeds[a].

    Each attempt is one vector of 63-bit random words from np.random.PCG64(seeds[a]) (default_rng's
    bit generator): n_context and n_key (uniform in their ranges), the table, and per level and
    part one sort key per child; a level's orders sort each parent's keys (a uniformly random
    permutation: one argsort per level instead of one rng.permutation per parent). Arrays are
    padded to the largest shape M = (*outer_levels, max_n_context, max_n_key); padding children
    get the largest keys, so each parent's first n children in order are its real ones, permuted.

    Returns:
      sizes: (a, len(M)) int, the table shape of each attempt.
      table: (a, *M) ints in [0, n_value).
      orders: per level d, (a, 2, *M[: d + 1]) ints: a parent's children in order, in the
        information part (index 0 of axis 1) and the inquiry part (1).
    """
    max_shape = (*outer_levels, max_n_context, max_n_key)
    count = draw_count(max_shape)
    raw = pcg64.raw_words(seeds, count)
    words = (raw >> 1).view(np.int64)  # modulo bias below 2**-58: negligible
    sizes = np.empty((len(seeds), len(max_shape)), np.int64)
    sizes[:] = max_shape
    for j, (lo, hi) in enumerate((n_context, n_key)):
        sizes[:, len(outer_levels) + j] = lo + words[:, j] % (hi - lo + 1)
    start = 2 + math.prod(max_shape)
    table = (words[:, 2:start] % n_value).reshape(-1, *max_shape)
    orders = []
    for d in range(len(max_shape)):
        stop = start + 2 * math.prod(max_shape[: d + 1])
        keys = words[:, start:stop].reshape(-1, 2, *max_shape[: d + 1])
        start = stop
        padding = np.arange(max_shape[d]) >= sizes[:, d].reshape(-1, *[1] * (d + 2))
        orders.append(np.argsort(np.where(padding, LAST, keys), axis=-1))
    return sizes, table, orders


def layout_batch(
    sizes, table, orders, *, n_value=16, max_n_context=16, max_n_key=16, outer_levels=()
):
    """Tokens and inquiry masks ((a, padded_length) int32) of a batch of drawn attempts.

    The fast twin of `layout_levels` (which defines the layout) on `draw`'s padded arrays: every
    token an attempt can hold is computed into one row (bos, sep, pad, then per level both parts'
    ids in order, then both parts' values), and the attempt's table shape picks its tokens from
    that row with a cached gather index (`_slots`).
    """
    max_shape = (*outer_levels, max_n_context, max_n_key)
    depth, batch = len(max_shape), len(sizes)
    bases = level_bases(n_value, max_n_context, max_n_key, tuple(outer_levels))

    def lead(d):
        """The attempt and part indices, broadcast against (a, 2, *M[: d + 1])."""
        ones = (1,) * (d + 1)
        return np.arange(batch).reshape(-1, 1, *ones), np.arange(2).reshape(1, 2, *ones)

    def expand(x, d):
        """x of shape (a, 2, *M[: e + 1]) broadcast against (a, 2, *M[: d + 1])."""
        return x.reshape(x.shape + (1,) * (d + 2 - (x.ndim - 1)))

    pieces = [np.full((batch, 3), (BOS, SEP, PAD))]
    ids = []  # ids[d][:, part, j_0, ..., j_d]: the level-d id reached by those order positions
    for d in range(depth):
        ids.append(orders[d][(*lead(d), *(expand(c, d) for c in ids), np.arange(max_shape[d]))])
        pieces.append((bases[d] + ids[d]).reshape(batch, -1))
    value = table[(lead(depth - 1)[0], *(expand(c, depth - 1) for c in ids))]
    pieces.append((VALUE_OFFSET + value).reshape(batch, -1))
    source = np.concatenate(pieces, axis=1)
    gather, mask = zip(*(_slots(tuple(s), max_shape) for s in sizes.tolist()), strict=True)
    tokens = source[np.arange(batch).reshape(-1, 1), np.stack(gather)].astype(np.int32)
    return tokens, np.stack(mask)


@functools.cache
def _slots(sizes: tuple[int, ...], max_shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Where `layout_batch`'s row of candidate tokens goes for a table of shape `sizes`: the
    gather index of every position (padded_length,) and the inquiry mask. A node reached by the
    order positions (j_0, ..., j_d) starts at sum_e j_e len_e + d within its part, len_e being the
    length of a level-e block (its token and its children's blocks)."""
    depth = len(max_shape)
    block = [2]  # a key and its value
    for d in range(depth - 2, -1, -1):
        block.insert(0, 1 + sizes[d + 1] * block[0])
    part_length = sizes[0] * block[0]
    length = padded_length(max_shape[-2], max_shape[-1], max_shape[:-2])
    gather = np.full(length, 2)  # the row's pad
    gather[0], gather[1 + part_length] = 0, 1  # bos, sep
    mask = np.zeros(length, np.int32)
    offset = 3
    for d in range(depth + 1):  # the levels, then the values
        level_shape = max_shape[: d + 1]
        grid = np.indices(sizes[: d + 1])
        source = offset + np.ravel_multi_index(grid, level_shape)
        for part in range(2):
            first = 1 + part * (part_length + 1) + min(d, depth - 1)
            node = first + sum(grid[e] * block[e] for e in range(min(d + 1, depth)))
            # A value follows its key: one position further.
            gather[node + (d == depth)] = source + part * math.prod(level_shape)
            if d == depth - 1:
                mask[node] = part
        offset += 2 * math.prod(level_shape)
    gather.flags.writeable = mask.flags.writeable = False  # shared by every call
    return gather, mask


def sample_batch(
    seeds,
    *,
    n_context=(5, 16),
    n_key=(5, 16),
    n_value=16,
    max_n_context=16,
    max_n_key=16,
    outer_levels=(),
):
    """Tokens and inquiry masks ((a, padded_length) int32) of attempts, attempt a from seeds[a]."""
    shape = {
        "n_value": n_value,
        "max_n_context": max_n_context,
        "max_n_key": max_n_key,
        "outer_levels": tuple(outer_levels),
    }
    return layout_batch(*draw(seeds, n_context=n_context, n_key=n_key, **shape), **shape)


class JointRecallSource:
    """A grain random-access source: example i of a split is a pure function of (seed, split, i).

    n_context and n_key are uniform in their ranges (the HAX code enumerates every pair equally
    often). Splits are disjoint by construction: an example belongs to the split whose range holds
    its hash, and each index draws (deterministically) until it gets one of its own split. With
    next_token=True, examples are the training schema of `to_example` (length padded_length - 1),
    else raw {"tokens", "mask"} (length padded_length). With cache_dir, every example is drawn at
    the first access and kept in that directory for later processes (split_cache): the same
    examples, drawn once per machine.
    """

    def __init__(
        self,
        split: str,
        size: int,
        *,
        seed: int = 0,
        n_context=(5, 16),
        n_key=(5, 16),
        n_value=16,
        max_n_context=16,
        max_n_key=16,
        outer_levels=(),
        vocab_size: int = 100,
        next_token: bool = False,
        cache_dir: Path | None = None,
    ):
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; known: {tuple(SPLITS)}")
        for name, (lo, hi), top in (
            ("n_context", n_context, max_n_context),
            ("n_key", n_key, max_n_key),
        ):
            if not 1 <= lo <= hi <= top:
                raise ValueError(f"{name}=({lo}, {hi}) must satisfy 1 <= lo <= hi <= {top}")
        if any(size < 1 for size in outer_levels):
            raise ValueError(f"outer_levels={tuple(outer_levels)} must all be positive")
        check_vocab(vocab_size, n_value, max_n_context, max_n_key, tuple(outer_levels))
        self.split, self.size, self.seed = split, size, seed
        self.n_context, self.n_key, self.next_token = n_context, n_key, next_token
        self.shape = {
            "n_value": n_value,
            "max_n_context": max_n_context,
            "max_n_key": max_n_key,
            "outer_levels": tuple(outer_levels),
        }
        self.words = draw_count((*outer_levels, max_n_context, max_n_key))  # an attempt's
        self.vocab_size, self.cache_dir, self.stored = vocab_size, cache_dir, None

    def __len__(self) -> int:
        """The number of examples."""
        return self.size

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        """{"tokens": (L,), "mask": (L,)} int32, or the schema of `to_example` with next_token."""
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} out of range for a {self.split} split of {self.size}")
        if self.cache_dir is None:
            tokens, mask = (x[0] for x in self._draw_rows(np.array([index])))
        else:
            tokens, mask = self._stored(index)
        return to_example(tokens, mask) if self.next_token else {"tokens": tokens, "mask": mask}

    def rows(self, indices) -> dict[str, np.ndarray]:
        """Examples `indices` stacked ((n, L) int32 each), as np.stack of __getitem__'s, in one
        vectorised draw: every index's next attempt at once, until each has one of its split."""
        indices = np.asarray(indices, np.int64)
        if indices.size and not (0 <= indices.min() and indices.max() < self.size):
            raise IndexError(f"indices out of range for a {self.split} split of {self.size}")
        if self.cache_dir is None:
            tokens, mask = self._draw_rows(indices)
        else:
            tokens, mask = self._stored(indices)
        if not self.next_token:
            return {"tokens": tokens, "mask": mask}
        return to_example(tokens, mask)

    def _draw_rows(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, mask) (n, L) of examples `indices`: each index's first attempt hashed into the
        split's range. Attempts are tried in order, every index still missing one at once, in
        rounds of up to about half the expected number each (1 for train, 50 for valid and test)
        and about 1M random words in all: the rounds change the speed, never the example."""
        lo, hi = SPLITS[self.split]
        length = padded_length(
            self.shape["max_n_context"], self.shape["max_n_key"], self.shape["outer_levels"]
        )
        tokens = np.empty((len(indices), length), np.int32)
        mask = np.empty((len(indices), length), np.int32)
        todo, first = np.arange(len(indices)), 0
        while todo.size:
            if first >= 1_000_000:
                raise RuntimeError("no example of this split found")  # unreachable: p >= 1%
            per = max(1, min(-(-500 // (hi - lo)), (1 << 20) // (self.words * todo.size)))
            seeds = [
                [self.seed, lo, int(indices[i]), a] for i in todo for a in range(first, first + per)
            ]
            drawn, drawn_mask = sample_batch(
                seeds, n_context=self.n_context, n_key=self.n_key, **self.shape
            )
            hit = np.array([lo <= example_hash(row) < hi for row in drawn]).reshape(-1, per)
            found = hit.any(axis=1)
            row = (np.arange(todo.size) * per + hit.argmax(axis=1))[found]  # each one's first hit
            tokens[todo[found]], mask[todo[found]] = drawn[row], drawn_mask[row]
            todo, first = todo[~found], first + per
        return tokens, mask

    def _stored(self, index) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, mask) int32 of example(s) `index` from the split cache (drawn at first use)."""
        if self.stored is None:
            name = self._cache_name()
            self.stored = split_cache.load_or_build(name, self._draw_all, self.cache_dir)
        return (
            self.stored["tokens"][index].astype(np.int32),
            self.stored["mask"][index].astype(np.int32),
        )

    def _cache_name(self) -> str:
        """The split's file name in the cache: its parameters and this generator's code."""
        params = {
            "split": self.split,
            "size": self.size,
            "seed": self.seed,
            "n_context": list(self.n_context),
            "n_key": list(self.n_key),
            "vocab_size": self.vocab_size,
            **self.shape,
        }
        code = (Path(__file__), Path(pcg64.__file__))  # the draw's code: a change redraws
        return split_cache.key(f"joint_recall-{self.split}", params, *code)

    def _draw_all(self) -> dict[str, np.ndarray]:
        """Every example, drawn on threads (numpy and the hash release the GIL), stored small."""
        with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
            drawn = list(pool.map(lambda i: self._draw_rows(np.array([i])), range(self.size)))
        dtype = np.uint8 if self.vocab_size <= 256 else np.int32
        return {
            "tokens": np.concatenate([t for t, _ in drawn]).astype(dtype),
            "mask": np.concatenate([m for _, m in drawn]).astype(bool),
        }


def example_hash(tokens: np.ndarray) -> int:
    """A stable hash of an example in [0, 1000): it decides the example's split."""
    return (
        int.from_bytes(hashlib.blake2b(tokens.tobytes(), digest_size=8).digest(), "little") % 1000
    )


def to_example(tokens: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
    """The training schema of a raw (tokens, mask) example (L,), or of a batch of them (n, L),
    shifted as the HAX trainer does."""
    inputs = np.asarray(tokens[..., :-1], np.int32)
    return {
        "inputs": inputs,
        "labels": np.asarray(tokens[..., 1:], np.int32),
        "loss_mask": np.asarray(mask[..., :-1], np.int32),
        "real": (inputs != PAD).astype(np.int32),
        "seq_idx": np.zeros_like(inputs),  # one sequence per row
    }


def next_token_batch(tokens: np.ndarray, mask: np.ndarray):
    """(inputs, labels, loss_mask, real) of a batch, as the HAX trainer builds them."""
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    return inputs, labels, mask[:, :-1].astype(bool), inputs != PAD


def inquiry_accuracy(predictions: np.ndarray, labels: np.ndarray, loss_mask: np.ndarray) -> float:
    """The paper's metric: per sample, the fraction of inquiry keys right; then the mean."""
    hits = ((predictions == labels) & loss_mask).sum(-1)
    return float(np.mean(hits / np.maximum(loss_mask.sum(-1), 1)))
