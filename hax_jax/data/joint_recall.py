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

import hashlib
import math

import numpy as np

BOS, PAD, SEP = 1, 3, 4
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
    outer_bases = context_base + max_n_context + np.cumsum((0, *outer_levels))[:-1]
    return (*map(int, outer_bases), context_base, key_base)


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


def _draw_orders(rng: np.random.Generator, shape: tuple[int, ...]) -> list[np.ndarray]:
    """Random orders of every level: per parent (in index order), a permutation of its children."""
    return [
        np.stack([rng.permutation(shape[d]) for _ in range(math.prod(shape[:d]))]).reshape(
            shape[: d + 1]
        )
        for d in range(len(shape))
    ]


def sample(
    rng: np.random.Generator,
    *,
    n_context: int,
    n_key: int,
    n_value=16,
    max_n_context=16,
    max_n_key=16,
    outer_levels=(),
):
    """One random example: a random table and random orders for both parts."""
    # Draw order (table, then each part's orders level by level) keeps two-level examples identical
    # to the original generator's.
    shape = (*outer_levels, n_context, n_key)
    table = rng.integers(0, n_value, shape)
    orders = _draw_orders(rng, shape)
    inquiry_orders = _draw_orders(rng, shape)
    return layout_levels(
        table,
        orders,
        inquiry_orders,
        n_value=n_value,
        max_n_context=max_n_context,
        max_n_key=max_n_key,
        outer_levels=outer_levels,
    )


class JointRecallSource:
    """A grain random-access source: example i of a split is a pure function of (seed, split, i).

    n_context and n_key are uniform in their ranges (the HAX code enumerates every pair equally
    often). Splits are disjoint by construction: an example belongs to the split whose range holds
    its hash, and each index draws (deterministically) until it gets one of its own split. With
    next_token=True, examples are the training schema of `to_example` (length padded_length - 1),
    else raw {"tokens", "mask"} (length padded_length).
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

    def __len__(self) -> int:
        """The number of examples."""
        return self.size

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        """{"tokens": (L,), "mask": (L,)} int32, or the schema of `to_example` with next_token."""
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} out of range for a {self.split} split of {self.size}")
        lo, hi = SPLITS[self.split]
        for attempt in range(1_000_000):
            rng = np.random.default_rng([self.seed, lo, index, attempt])
            tokens, mask = sample(
                rng,
                n_context=int(rng.integers(self.n_context[0], self.n_context[1] + 1)),
                n_key=int(rng.integers(self.n_key[0], self.n_key[1] + 1)),
                **self.shape,
            )
            if lo <= example_hash(tokens) < hi:
                return (
                    to_example(tokens, mask)
                    if self.next_token
                    else {"tokens": tokens, "mask": mask}
                )
        raise RuntimeError(
            "no example of this split found"
        )  # unreachable: each draw lands with p >= 1%


def example_hash(tokens: np.ndarray) -> int:
    """A stable hash of an example in [0, 1000): it decides the example's split."""
    return (
        int.from_bytes(hashlib.blake2b(tokens.tobytes(), digest_size=8).digest(), "little") % 1000
    )


def to_example(tokens: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
    """The training schema of a raw (tokens, mask) example, shifted as the HAX trainer does."""
    inputs = np.asarray(tokens[:-1], np.int32)
    return {
        "inputs": inputs,
        "labels": np.asarray(tokens[1:], np.int32),
        "loss_mask": np.asarray(mask[:-1], np.int32),
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
