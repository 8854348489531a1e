"""Multi-query joint recall (HAX paper §3.2), with the token layout of the HAX code's generator.

Tokens: bos 1, pad 3, sep 4, values 10.., keys 10 + n_value.., contexts 10 + n_value + max_n_key.. (with the
defaults: values 10..25, keys 26..41, contexts 42..57, vocab 100). A sequence is bos, then every context (in a
random order) followed by all its key-value pairs (keys in a random order), sep, then the inquiry part: the
contexts and keys re-permuted, each key followed by its value; padded to (2 max_n_context)(2 max_n_key + 1) + 2
(1058). The loss and the accuracy are taken at the inquiry keys, predicting the value that follows.
"""

import hashlib

import numpy as np

BOS, PAD, SEP = 1, 3, 4
VALUE_OFFSET = 10
SPLITS = {
    "train": (0, 980),
    "valid": (980, 990),
    "test": (990, 1000),
}  # example-hash ranges out of 1000


def padded_length(max_n_context: int, max_n_key: int) -> int:
    """The fixed sequence length of the HAX code: room for twice the largest table, plus bos and sep."""
    return (2 * max_n_context) * (2 * max_n_key + 1) + 2


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
    """Tokens and inquiry mask (int32 arrays of padded_length) of one example.

    Args:
      table: (n_context, n_key) ints in [0, n_value): the value of key k in context c.
      context_order, inquiry_context_order: permutations of the contexts (information / inquiry part).
      key_orders, inquiry_key_orders: per context (indexed by context id), a permutation of its keys.
    """
    table = np.asarray(table)
    n_context, n_key = table.shape
    if not (1 <= n_context <= max_n_context and 1 <= n_key <= max_n_key):
        raise ValueError(
            f"table shape {table.shape} must be within (max_n_context={max_n_context}, "
            f"max_n_key={max_n_key})"
        )
    key_base, context_base = VALUE_OFFSET + n_value, VALUE_OFFSET + n_value + max_n_key
    tokens, mask = [BOS], [0]
    for part, (contexts, key_orders_) in enumerate(
        ((context_order, key_orders), (inquiry_context_order, inquiry_key_orders))
    ):
        if part == 1:
            tokens.append(SEP)
            mask.append(0)
        for c in contexts:
            tokens.append(context_base + c)
            mask.append(0)
            for k in key_orders_[c]:
                tokens += [key_base + k, VALUE_OFFSET + int(table[c, k])]
                mask += [part, 0]  # in the inquiry part, the key predicts the value after it
    length = padded_length(max_n_context, max_n_key)
    tokens += [PAD] * (length - len(tokens))
    mask += [0] * (length - len(mask))
    return np.asarray(tokens, np.int32), np.asarray(mask, np.int32)


def sample(
    rng: np.random.Generator,
    *,
    n_context: int,
    n_key: int,
    n_value=16,
    max_n_context=16,
    max_n_key=16,
):
    """One random example: a random table and random orders for both parts."""
    table = rng.integers(0, n_value, (n_context, n_key))
    return layout(
        table,
        rng.permutation(n_context),
        [rng.permutation(n_key) for _ in range(n_context)],
        rng.permutation(n_context),
        [rng.permutation(n_key) for _ in range(n_context)],
        n_value=n_value,
        max_n_context=max_n_context,
        max_n_key=max_n_key,
    )


class JointRecallSource:
    """A grain random-access source: example i of a split is a pure function of (seed, split, i).

    n_context and n_key are uniform in their ranges (the HAX code enumerates every pair equally often).
    Splits are disjoint by construction: an example belongs to the split whose range holds its hash, and
    each index draws (deterministically) until it gets one of its own split.
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
    ):
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; known: {tuple(SPLITS)}")
        for name, (lo, hi), top in (
            ("n_context", n_context, max_n_context),
            ("n_key", n_key, max_n_key),
        ):
            if not 1 <= lo <= hi <= top:
                raise ValueError(f"{name}=({lo}, {hi}) must satisfy 1 <= lo <= hi <= {top}")
        self.split, self.size, self.seed = split, size, seed
        self.n_context, self.n_key = n_context, n_key
        self.shape = dict(n_value=n_value, max_n_context=max_n_context, max_n_key=max_n_key)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        """{"tokens": (L,), "mask": (L,)} int32."""
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
                return {"tokens": tokens, "mask": mask}
        raise RuntimeError(
            "no example of this split found"
        )  # unreachable: each draw lands with p >= 1%


def example_hash(tokens: np.ndarray) -> int:
    """A stable hash of an example in [0, 1000): it decides the example's split."""
    return (
        int.from_bytes(hashlib.blake2b(tokens.tobytes(), digest_size=8).digest(), "little") % 1000
    )


def next_token_batch(tokens: np.ndarray, mask: np.ndarray):
    """(inputs, labels, loss_mask, real) for next-token prediction, as the HAX code's trainer builds them."""
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    return inputs, labels, mask[:, :-1].astype(bool), inputs != PAD


def inquiry_accuracy(predictions: np.ndarray, labels: np.ndarray, loss_mask: np.ndarray) -> float:
    """The paper's metric: per sample, the fraction of inquiry keys whose value is predicted; then the mean."""
    hits = ((predictions == labels) & loss_mask).sum(-1)
    return float(np.mean(hits / np.maximum(loss_mask.sum(-1), 1)))
