"""MQAR: Zoology's layout and power-law gaps, the harder variant, the curriculum, bad arguments."""

import numpy as np
import pytest

from hax_jax.data import mqar


def test_layout_labels_and_zero_fill():
    row = mqar.sample(
        np.random.default_rng(0), num_kv_pairs=3, seq_len=20, vocab_size=16, random_fill=False
    )
    inputs, labels, loss_mask = row["inputs"], row["labels"], row["loss_mask"]
    assert all(v.shape == (20,) and v.dtype == np.int32 for v in row.values())
    keys, values = inputs[0:6:2], inputs[1:6:2]
    assert len(set(keys)) == 3 and np.all((keys >= 1) & (keys <= 7))
    assert len(set(values)) == 3 and np.all((values >= 8) & (values <= 15))
    np.testing.assert_array_equal(labels[:-1], inputs[1:])  # labels are the next tokens
    queries = np.flatnonzero(loss_mask)
    assert len(queries) == 3 and np.all(queries >= 6) and np.all((queries - 6) % 2 == 0)
    table = dict(zip(keys, values))
    assert sorted(inputs[queries]) == sorted(keys)  # every key is asked once ...
    assert all(labels[q] == table[inputs[q]] for q in queries)  # ... and its label is its value
    used = set(range(6)) | set(queries) | set(queries + 1)
    assert not inputs[[t for t in range(20) if t not in used]].any()  # the rest is 0
    assert row["real"].all() and not row["seq_idx"].any()


def test_random_fill_and_power_law_gaps():
    rows = [
        mqar.sample(np.random.default_rng(s), num_kv_pairs=1, seq_len=64, vocab_size=64)
        for s in range(300)
    ]
    gaps = np.array([(np.flatnonzero(r["loss_mask"])[0] - 2) // 2 for r in rows])
    # p(gap = 0) = 1 / sum_g (g + 1)^-0.99 over 31 slots, about 0.25 (uniform: 0.03).
    p = mqar.gap_probabilities(31)
    assert p[0] == pytest.approx(0.25, abs=0.02) and np.all(np.diff(p) < 0)
    assert 45 < np.sum(gaps == 0) < 110
    fill = np.concatenate(
        [np.delete(r["inputs"], [0, 1, 2 + 2 * g, 3 + 2 * g]) for r, g in zip(rows, gaps)]
    )
    assert len(np.unique(fill)) == 64  # the harder variant: random tokens from the whole vocab
    zero = mqar.sample(
        np.random.default_rng(0), num_kv_pairs=1, seq_len=64, vocab_size=64, random_fill=False
    )
    assert np.count_nonzero(zero["inputs"]) == 4


def test_sources_are_deterministic_and_splits_differ():
    args = {"num_kv_pairs": 4, "seq_len": 32, "vocab_size": 64}
    valid, again = mqar.MqarSource("valid", 8, **args), mqar.MqarSource("valid", 8, **args)
    test = mqar.MqarSource("test", 8, **args)
    np.testing.assert_array_equal(valid[3]["inputs"], again[3]["inputs"])
    assert not np.array_equal(valid[3]["inputs"], test[3]["inputs"])
    other = mqar.MqarSource("valid", 8, seed=1, **args)
    assert not np.array_equal(valid[3]["inputs"], other[3]["inputs"])
    assert valid[5]["loss_mask"].sum() == 4
    with pytest.raises(IndexError, match="index 8 out of range"):
        valid[8]


def test_curriculum_stream_order():
    src = mqar.MqarCurriculumSource(
        stages=(2, 4), stage_examples=5, stage_epochs=3, seq_len=32, vocab_size=64, seed=0
    )
    assert len(src) == 2 * 5 * 3
    positions = [src.position(i) for i in range(len(src))]
    assert [p[:2] for p in positions] == [
        (s, e) for s in range(2) for e in range(3) for _ in range(5)
    ]
    for s in range(2):
        epochs = [[p[2] for p in positions if p[:2] == (s, e)] for e in range(3)]
        assert all(sorted(order) == list(range(5)) for order in epochs)  # each epoch: every example
        assert len({tuple(order) for order in epochs}) > 1  # ... in a fresh order
    assert all(src[i]["loss_mask"].sum() == 2 for i in range(15))
    assert all(src[i]["loss_mask"].sum() == 4 for i in range(15, 30))
    # The same example in two epochs is the same row.
    example_at = {(p[0], p[2]): i for i, p in enumerate(positions[:5])}
    for i, (stage, _epoch, example) in enumerate(positions[5:10], start=5):
        np.testing.assert_array_equal(src[i]["inputs"], src[example_at[stage, example]]["inputs"])


def test_bad_arguments_name_values():
    with pytest.raises(ValueError, match=r"seq_len=15 is too short for num_kv_pairs=4.*>= 16"):
        mqar.MqarSource("valid", 3, num_kv_pairs=4, seq_len=15, vocab_size=64)
    with pytest.raises(ValueError, match="vocab_size=9 is too small for num_kv_pairs=4"):
        mqar.MqarSource("valid", 3, num_kv_pairs=4, seq_len=16, vocab_size=9)
    mqar.MqarSource("valid", 3, num_kv_pairs=4, seq_len=16, vocab_size=10)  # keys 1..4: just fits
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        mqar.MqarSource("dev", 3, num_kv_pairs=4, seq_len=16, vocab_size=64)
    with pytest.raises(ValueError, match="seq_len=32 is too short for num_kv_pairs=16"):
        mqar.MqarCurriculumSource(
            stages=(4, 16), stage_examples=2, stage_epochs=1, seq_len=32, vocab_size=64
        )
