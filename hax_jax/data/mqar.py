"""Multi-query associative recall (Zoology `multiquery_ar`), harder variant (Mamba-2 paper §9.1).

A row of the model's length L: the kv pairs first (keys from 1 .. vocab_size // 2 - 1, values from
vocab_size // 2 .. vocab_size - 1, all distinct within a row), then every key asked again, each at
an even offset 2 * gap after the kv pairs with Zoology's power-law gaps (small gaps likelier).
Unlike Zoology, the value follows its query in the inputs, so labels are always the next tokens (the
HAX trainer's convention); the loss_mask is 1 exactly at the queries, whose label is the queried
value, so what is learned and scored is Zoology's. Other positions are random tokens from the whole
vocabulary (random_fill, the harder variant) or 0 (never a key).
"""

import grain
import numpy as np

POWER_A = 0.01  # Zoology's default gap law: p(gap) ~ (gap + 1) ** (POWER_A - 1)
SPLIT_CODES = {"train": 0, "valid": 1, "test": 2}  # separate seed streams per split


def check_args(*, num_kv_pairs: int, seq_len: int, vocab_size: int) -> None:
    """Raises ValueError (naming values) unless a row holds the kv pairs and their queries."""
    if num_kv_pairs < 1:
        raise ValueError(f"num_kv_pairs={num_kv_pairs} must be positive")
    if seq_len < 4 * num_kv_pairs:
        raise ValueError(
            f"seq_len={seq_len} is too short for num_kv_pairs={num_kv_pairs}: the kv pairs take "
            f"{2 * num_kv_pairs} tokens and each query a further 2 (seq_len >= {4 * num_kv_pairs})"
        )
    if vocab_size // 2 - 1 < num_kv_pairs:
        raise ValueError(
            f"vocab_size={vocab_size} is too small for num_kv_pairs={num_kv_pairs}: keys are the "
            f"{vocab_size // 2 - 1} ids 1 .. {vocab_size // 2 - 1} "
            f"(vocab_size >= {2 * num_kv_pairs + 2})"
        )


def gap_probabilities(space: int, power_a: float = POWER_A) -> np.ndarray:
    """Zoology's power law over the query slots 0 .. space - 1 (power_a = 1 is uniform)."""
    p = power_a * np.arange(1, space + 1, dtype=np.float64) ** (power_a - 1)
    return p / p.sum()


def sample(
    rng: np.random.Generator,
    *,
    num_kv_pairs: int,
    seq_len: int,
    vocab_size: int,
    random_fill: bool = True,
    power_a: float = POWER_A,
) -> dict[str, np.ndarray]:
    """One row in the schema (inputs, labels, loss_mask, real, seq_idx), each (seq_len,) int32."""
    n, context = num_kv_pairs, 2 * num_kv_pairs
    keys = rng.choice(np.arange(1, vocab_size // 2), n, replace=False)
    values = rng.choice(np.arange(vocab_size // 2, vocab_size), n, replace=False)
    space = (seq_len - context) // 2
    gaps = rng.choice(space, n, replace=False, p=gap_probabilities(space, power_a))
    if random_fill:
        tokens = rng.integers(0, vocab_size, seq_len + 1)
    else:
        tokens = np.zeros(seq_len + 1, np.int64)
    tokens[0:context:2], tokens[1:context:2] = keys, values
    queries = context + 2 * gaps
    tokens[queries], tokens[queries + 1] = keys, values  # queries + 1 <= seq_len - 1: inside inputs
    loss_mask = np.zeros(seq_len, np.int32)
    loss_mask[queries] = 1
    return {
        "inputs": tokens[:-1].astype(np.int32),
        "labels": tokens[1:].astype(np.int32),
        "loss_mask": loss_mask,
        "real": np.ones(seq_len, np.int32),
        "seq_idx": np.zeros(seq_len, np.int32),
    }


class MqarSource:
    """A grain random-access source of MQAR rows at a fixed num_kv_pairs (validation and test)."""

    def __init__(
        self,
        split: str,
        size: int,
        *,
        num_kv_pairs: int,
        seq_len: int,
        vocab_size: int,
        random_fill: bool = True,
        seed: int = 0,
    ):
        if split not in SPLIT_CODES:
            raise ValueError(f"unknown split {split!r}; known: {tuple(SPLIT_CODES)}")
        check_args(num_kv_pairs=num_kv_pairs, seq_len=seq_len, vocab_size=vocab_size)
        self.split, self.size, self.seed = split, size, seed
        self.args = {
            "num_kv_pairs": num_kv_pairs,
            "seq_len": seq_len,
            "vocab_size": vocab_size,
            "random_fill": random_fill,
        }

    def __len__(self) -> int:
        """The number of examples."""
        return self.size

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        """Example `index`: a pure function of (seed, split, index)."""
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} out of range for a {self.split} split of {self.size}")
        rng = np.random.default_rng([self.seed, SPLIT_CODES[self.split], 0, index])
        return sample(rng, **self.args)


class MqarCurriculumSource:
    """The training stream: per stage (a kv-pair count), stage_examples rows, stage_epochs times.

    Position i of the stream is (stage, epoch, example) in that order, with a fresh permutation of
    the stage's examples every epoch; so it is already shuffled and the pipeline must keep its
    order. Repeating the source restarts the curriculum.
    """

    def __init__(
        self,
        *,
        stages: tuple[int, ...],
        stage_examples: int,
        stage_epochs: int,
        seq_len: int,
        vocab_size: int,
        random_fill: bool = True,
        seed: int = 0,
    ):
        if not stages:
            raise ValueError("stages must name at least one kv-pair count")
        if stage_examples < 1 or stage_epochs < 1 or stage_examples > 2**32:
            raise ValueError(
                f"stage_examples={stage_examples} must be in [1, 2**32] and "
                f"stage_epochs={stage_epochs} positive"
            )
        for n in stages:
            check_args(num_kv_pairs=n, seq_len=seq_len, vocab_size=vocab_size)
        self.stages, self.seed = tuple(stages), seed
        self.stage_examples, self.stage_epochs = stage_examples, stage_epochs
        self.args = {"seq_len": seq_len, "vocab_size": vocab_size, "random_fill": random_fill}

    def __len__(self) -> int:
        """The stream's length: stages x stage_examples x stage_epochs."""
        return len(self.stages) * self.stage_examples * self.stage_epochs

    def position(self, index: int) -> tuple[int, int, int]:
        """(stage, epoch, example) at stream position `index`."""
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for a curriculum of {len(self)}")
        stage, rest = divmod(index, self.stage_examples * self.stage_epochs)
        epoch, slot = divmod(rest, self.stage_examples)
        # A random-access permutation (no O(stage_examples) array per epoch).
        perm_seed = int(np.random.SeedSequence([self.seed, stage, epoch]).generate_state(1)[0])
        example = grain.experimental.index_shuffle(
            slot, max_index=self.stage_examples - 1, seed=perm_seed, rounds=4
        )
        return stage, epoch, int(example)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        """The example at stream position `index`."""
        stage, _, example = self.position(index)
        rng = np.random.default_rng([self.seed, SPLIT_CODES["train"], stage, example])
        return sample(rng, num_kv_pairs=self.stages[stage], **self.args)
