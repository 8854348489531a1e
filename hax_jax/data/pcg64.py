"""NumPy's PCG64 streams for many seeds at once: np.random.PCG64(seed).random_raw(count) for a
batch of seeds of four 32-bit words, the seed hashing (SeedSequence) vectorised over the batch.

Both algorithms are fixed by NumPy's stream-compatibility policy (NEP 19); one bit generator is set
to each hashed state in turn. np.random.PCG64(seed) per joint-recall attempt was half of a training
batch's time.
"""

import numpy as np

_SEED_HASH = (0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED)  # INIT_A, MULT_A, INIT_B, MULT_B
_SEED_MIX = (0xCA01F9DD, 0x4973F715)  # MIX_MULT_L, MIX_MULT_R
_PCG_MULT = 0x2360ED051FC65DA44385DF649FCCF645
_MASK128 = (1 << 128) - 1


def raw_words(seeds, count: int) -> np.ndarray:
    """(a, count) uint64: np.random.PCG64(seeds[a]).random_raw(count) for every a."""
    try:
        entropy = np.asarray(seeds, dtype=np.int64)
    except (OverflowError, TypeError, ValueError):  # ragged, or a word past 63 bits
        entropy = None
    if (
        len(seeds) < 8  # the vectorised hashing's fixed cost is that of about 8 seeds' own
        or entropy is None
        or entropy.ndim != 2
        or entropy.shape[1] != 4
        or not (0 <= entropy.min() and entropy.max() < 1 << 32)
    ):
        return np.stack([np.random.PCG64(s).random_raw(count) for s in seeds])
    words = _seed_state(entropy.astype(np.uint32))
    generator = np.random.PCG64()
    out = np.empty((len(words), count), np.uint64)
    for a, (s0, s1, i0, i1) in enumerate(words.tolist()):
        inc = ((((i0 << 64) | i1) << 1) | 1) & _MASK128
        state = ((inc + ((s0 << 64) | s1)) * _PCG_MULT + inc) & _MASK128  # the seeding's two steps
        generator.state = {
            "bit_generator": "PCG64",
            "state": {"state": state, "inc": inc},
            "has_uint32": 0,
            "uinteger": 0,
        }
        out[a] = generator.random_raw(count)
    return out


def _seed_state(entropy: np.ndarray) -> np.ndarray:
    """(a, 4) uint64: SeedSequence(row).generate_state(4, np.uint64) of each (a, 4) uint32 row."""
    init_a, mult_a, init_b, mult_b = (np.uint32(c) for c in _SEED_HASH)
    mix_l, mix_r = (np.uint32(c) for c in _SEED_MIX)
    shift = np.uint32(16)
    hash_const = init_a  # the same sequence of constants for every row

    def hashmix(value):
        nonlocal hash_const
        value = value ^ hash_const
        hash_const = hash_const * mult_a
        value = value * hash_const
        return value ^ (value >> shift)

    with np.errstate(over="ignore"):  # uint32 arithmetic wraps, as the C code's
        pool = [hashmix(entropy[:, i]) for i in range(4)]
        for src in range(4):
            for dst in range(4):
                if src != dst:
                    mixed = mix_l * pool[dst] - mix_r * hashmix(pool[src])
                    pool[dst] = mixed ^ (mixed >> shift)
        hash_const, state = init_b, []
        for i in range(8):
            value = pool[i % 4] ^ hash_const
            hash_const = hash_const * mult_b
            value = value * hash_const
            state.append(value ^ (value >> shift))
    return np.ascontiguousarray(np.stack(state, axis=1)).view("<u8")
