"""Joint recall: the HAX code's token layout, determinism, disjoint splits, the paper's accuracy."""

import grain
import numpy as np
import pytest

from hax_jax.data import joint_recall as jr


def test_layout_matches_a_hand_written_example():
    # 2 contexts x 2 keys, max 2 contexts x 3 keys: contexts are 10 + 16 + 3 + c = 29, 30; keys 26 +
    # k.
    tokens, mask = jr.layout(
        [[3, 7], [0, 15]],
        context_order=[1, 0],
        key_orders=[[1, 0], [0, 1]],
        inquiry_context_order=[0, 1],
        inquiry_key_orders=[[0, 1], [1, 0]],
        max_n_context=2,
        max_n_key=3,
    )
    expected = [
        1,
        30,
        26,
        10,
        27,
        25,  # context 1: key 0 -> value 0, key 1 -> value 15
        29,
        27,
        17,
        26,
        13,  # context 0: key 1 -> value 7, key 0 -> value 3
        4,
        29,
        26,
        13,
        27,
        17,  # inquiry: context 0, keys 0 then 1
        30,
        27,
        25,
        26,
        10,
    ]  # inquiry: context 1, keys 1 then 0
    expected += [3] * (jr.padded_length(2, 3) - len(expected))
    np.testing.assert_array_equal(tokens, expected)
    inquiry_keys = [13, 15, 18, 20]  # after sep (11) and the context token (12)
    np.testing.assert_array_equal(np.flatnonzero(mask), inquiry_keys)
    assert len(tokens) == (2 * 2) * (2 * 3 + 1) + 2


def test_default_token_ranges_and_length():
    src = jr.JointRecallSource("train", 50, seed=1)
    for i in range(50):
        tokens, mask = src[i]["tokens"], src[i]["mask"]
        assert tokens.shape == mask.shape == (1058,) and tokens.dtype == np.int32
        body = tokens[tokens != jr.PAD]
        assert set(np.unique(body)) <= {1, 4} | set(range(10, 58))
        n_context = np.sum((body >= 42) & (body <= 57)) // 2
        n_key_pairs = mask.sum()
        assert (
            5 <= n_context <= 16
            and n_key_pairs % n_context == 0
            and 5 <= n_key_pairs // n_context <= 16
        )
        values = tokens[np.flatnonzero(mask) + 1]
        assert np.all((values >= 10) & (values <= 25))


def test_deterministic_and_splits_disjoint():
    train = jr.JointRecallSource("train", 300, seed=3)
    valid = jr.JointRecallSource("valid", 30, seed=3)
    again = jr.JointRecallSource("train", 300, seed=3)
    np.testing.assert_array_equal(train[17]["tokens"], again[17]["tokens"])
    other_seed = jr.JointRecallSource("train", 300, seed=4)
    assert not np.array_equal(train[17]["tokens"], other_seed[17]["tokens"])
    train_keys = {train[i]["tokens"].tobytes() for i in range(300)}
    valid_keys = {valid[i]["tokens"].tobytes() for i in range(30)}
    assert not train_keys & valid_keys
    assert all(
        jr.SPLITS["valid"][0] <= jr.example_hash(valid[i]["tokens"]) < jr.SPLITS["valid"][1]
        for i in range(30)
    )
    batch = grain.MapDataset.source(valid).batch(8)[0]
    assert batch["tokens"].shape == (8, 1058)


def test_accuracy_is_per_sample_then_averaged():
    tokens = np.stack(
        [
            jr.sample(np.random.default_rng(s), n_context=c, n_key=k)[0]
            for s, c, k in ((0, 5, 5), (1, 8, 9))
        ]
    )
    mask = np.stack(
        [
            jr.sample(np.random.default_rng(s), n_context=c, n_key=k)[1]
            for s, c, k in ((0, 5, 5), (1, 8, 9))
        ]
    )
    inputs, labels, loss_mask, real = jr.next_token_batch(tokens, mask)
    assert inputs.shape == labels.shape == loss_mask.shape == (2, 1057)
    assert np.all(labels[loss_mask] >= 10) and np.all(labels[loss_mask] <= 25)
    assert not real[0, -1] and real[0, 0]
    predictions = labels.copy()
    assert jr.inquiry_accuracy(predictions, labels, loss_mask) == 1.0
    # Row 0 all right (25 keys); row 1 right on half of its 72 keys: the paper averages 1.0 and 0.5.
    wrong = np.flatnonzero(loss_mask[1])[::2]
    predictions[1, wrong] = 0
    assert jr.inquiry_accuracy(predictions, labels, loss_mask) == pytest.approx(0.75)


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        jr.JointRecallSource("dev", 3)
    with pytest.raises(ValueError, match=r"n_key=\(5, 17\) must satisfy"):
        jr.JointRecallSource("train", 3, n_key=(5, 17))
    with pytest.raises(IndexError, match="index 3 out of range"):
        jr.JointRecallSource("train", 3)[3]


def test_three_level_layout_matches_a_hand_written_example():
    # outer_levels=(2,), 2 contexts x 2 keys, max 2 x 2: keys 26, 27; contexts 28, 29; outer 30, 31.
    table = [[[1, 2], [3, 4]], [[5, 6], [7, 8]]]  # table[outer][context][key]: values 11 .. 18
    orders = [[1, 0], [[0, 1], [1, 0]], [[[0, 1], [1, 0]], [[1, 0], [0, 1]]]]
    inquiry_orders = [[0, 1], [[1, 0], [0, 1]], [[[1, 0], [0, 1]], [[0, 1], [1, 0]]]]
    tokens, mask = jr.layout_levels(
        table, orders, inquiry_orders, max_n_context=2, max_n_key=2, outer_levels=(2,)
    )
    # fmt: off
    expected = [
        1,
        31, 29, 26, 17, 27, 18, 28, 27, 16, 26, 15,  # outer 1: context 1 (keys 0, 1), 0 (keys 1, 0)
        30, 28, 26, 11, 27, 12, 29, 27, 14, 26, 13,  # outer 0: context 0 (keys 0, 1), 1 (keys 1, 0)
        4,
        30, 29, 26, 13, 27, 14, 28, 27, 12, 26, 11,  # inquiry: outer 0, context 1 then 0
        31, 28, 26, 15, 27, 16, 29, 27, 18, 26, 17,  # inquiry: outer 1, context 0 then 1
    ]
    # fmt: on
    assert jr.padded_length(2, 2, (2,)) == len(expected) == 46
    np.testing.assert_array_equal(tokens, expected)
    np.testing.assert_array_equal(np.flatnonzero(mask), [26, 28, 31, 33, 37, 39, 42, 44])


def test_multi_level_examples_ask_every_entry_and_fit_the_vocab():
    src = jr.JointRecallSource(
        "train",
        20,
        seed=2,
        n_context=(2, 4),
        n_key=(2, 3),
        max_n_context=4,
        max_n_key=3,
        outer_levels=(2, 3),
    )
    length = jr.padded_length(4, 3, (2, 3))
    assert length == 2 * (2 * (1 + 3 * (1 + 4 * (1 + 2 * 3)))) + 2
    outer_bases = jr.level_bases(16, 4, 3, (2, 3))[:2]
    assert outer_bases == (33, 35)  # contexts 29..32, then 2 outer-0 tokens, then 3 outer-1 tokens
    for i in range(20):
        tokens, mask = src[i]["tokens"], src[i]["mask"]
        assert tokens.shape == (length,)
        sep = int(np.flatnonzero(tokens == jr.SEP)[0])
        info, inquiry = tokens[1:sep], tokens[sep + 1 :][tokens[sep + 1 :] != jr.PAD]
        assert sorted(info) == sorted(inquiry)  # the inquiry re-asks exactly the information part
        n_context = np.sum((info >= 29) & (info <= 32)) // 6  # each context appears in 2 x 3 blocks
        n_keys = np.sum((info >= 26) & (info <= 28))
        assert mask.sum() == n_keys and n_keys % (6 * n_context) == 0
        assert np.sum(info == 33) == 1 and np.sum((info >= 35) & (info <= 37)) == 2 * 3
        assert tokens.max() < 100
    # Orders differ between the parts at every level (the inquiry re-permutes each one).
    first = [src[i]["tokens"] for i in range(20)]
    assert any(not np.array_equal(t[1 : len(t) // 2], t[len(t) // 2 + 1 :]) for t in first)


def test_vocab_bound_names_the_values():
    jr.JointRecallSource("train", 3, outer_levels=(30, 12))  # tokens up to 99: fits in 100
    with pytest.raises(ValueError, match=r"reach 100 .*outer_levels=\(30, 13\); vocab_size=100"):
        jr.JointRecallSource("train", 3, outer_levels=(30, 13))
    with pytest.raises(ValueError, match="vocab_size=50 is too small"):
        jr.JointRecallSource("train", 3, vocab_size=50)


def test_next_token_schema_source():
    raw = jr.JointRecallSource("valid", 4, seed=5)
    schema = jr.JointRecallSource("valid", 4, seed=5, next_token=True)
    tokens = np.stack([raw[i]["tokens"] for i in range(4)])
    mask = np.stack([raw[i]["mask"] for i in range(4)])
    inputs, labels, loss_mask, real = jr.next_token_batch(tokens, mask)
    rows = [schema[i] for i in range(4)]
    assert set(rows[0]) == {"inputs", "labels", "loss_mask", "real", "seq_idx"}
    for name, want in (("inputs", inputs), ("labels", labels), ("loss_mask", loss_mask)):
        np.testing.assert_array_equal(np.stack([r[name] for r in rows]), want.astype(np.int32))
    np.testing.assert_array_equal(np.stack([r["real"] for r in rows]), real.astype(np.int32))
    assert all(r["inputs"].dtype == np.int32 and r["inputs"].shape == (1057,) for r in rows)
    assert all(not r["seq_idx"].any() for r in rows)
