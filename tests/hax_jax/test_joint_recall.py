"""Joint recall: the HAX code's token layout, determinism, disjoint splits, the paper's accuracy."""

import time
from concurrent.futures import ThreadPoolExecutor

import grain
import numpy as np
import pytest

from hax_jax.data import joint_recall as jr
from hax_jax.data import pcg64, split_cache


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
    tokens, mask = np.concatenate(
        [
            jr.sample_batch([s], n_context=(c, c), n_key=(k, k))
            for s, c, k in ((0, 5, 5), (1, 8, 9))
        ],
        axis=1,
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


def crop(sizes, table, orders):
    """One drawn attempt's table and orders at its own shape (`layout_levels`' arguments)."""
    table = table[tuple(slice(n) for n in sizes)]
    orders = [o[tuple(slice(n) for n in sizes[: d + 1])] for d, o in enumerate(orders)]
    return table, orders


@pytest.mark.parametrize("outer_levels", [(), (1,), (2,), (3, 2)])
def test_fast_layout_matches_the_recursive_layout(outer_levels):
    rng = np.random.default_rng(len(outer_levels))
    for trial in range(12):
        max_n_context, max_n_key = rng.integers(1, 6, 2)
        lo_c, lo_k = rng.integers(1, max_n_context + 1), rng.integers(1, max_n_key + 1)
        # Ranges hit both ends: the minimum 1 and the maximum (every slot real).
        n_context = [(1, 1), (max_n_context, max_n_context), (lo_c, max_n_context)][trial % 3]
        n_key = [(1, 1), (max_n_key, max_n_key), (lo_k, max_n_key)][trial // 3 % 3]
        shape = dict(
            n_value=int(rng.integers(1, 20)),
            max_n_context=int(max_n_context),
            max_n_key=int(max_n_key),
            outer_levels=outer_levels,
        )
        seeds = [[trial, a] for a in range(7)]
        draws = jr.draw(seeds, n_context=n_context, n_key=n_key, **shape)
        tokens, mask = jr.layout_batch(*draws, **shape)
        sizes, tables, orders_a = draws
        for a in range(len(seeds)):
            table, orders = crop(sizes[a], tables[a], [o[a, 0] for o in orders_a])
            _, inquiry_orders = crop(sizes[a], tables[a], [o[a, 1] for o in orders_a])
            for o in (*orders, *inquiry_orders):  # every parent orders all its real children
                np.testing.assert_array_equal(np.sort(o, axis=-1), np.broadcast_to(
                    np.arange(o.shape[-1]), o.shape))  # fmt: skip
            want = jr.layout_levels(table, orders, inquiry_orders, **shape)
            np.testing.assert_array_equal(tokens[a], want[0])
            np.testing.assert_array_equal(mask[a], want[1])
        # An attempt depends on its seed only: batching is a speed-up.
        single = jr.sample_batch(seeds[3:4], n_context=n_context, n_key=n_key, **shape)
        np.testing.assert_array_equal(single[0][0], tokens[3])


@pytest.mark.parametrize("split", ["train", "valid"])
def test_an_example_is_its_splits_first_attempt(split):
    # The obvious twin of __getitem__: try the attempts one by one.
    src = jr.JointRecallSource(split, 5, seed=7, n_context=(2, 4), n_key=(1, 3), max_n_key=3)
    lo, hi = jr.SPLITS[split]
    for index in range(5):
        for attempt in range(10_000):
            seeds = [[7, lo, index, attempt]]
            tokens, mask = jr.sample_batch(seeds, n_context=(2, 4), n_key=(1, 3), max_n_key=3)
            if lo <= jr.example_hash(tokens[0]) < hi:
                break
        np.testing.assert_array_equal(src[index]["tokens"], tokens[0])
        np.testing.assert_array_equal(src[index]["mask"], mask[0])


@pytest.mark.parametrize("split, next_token", [("valid", True), ("test", False)])
def test_a_cached_split_holds_the_same_examples_and_is_drawn_once(
    tmp_path, monkeypatch, split, next_token
):
    shape = {
        "seed": 7,
        "n_context": (2, 4),
        "n_key": (1, 3),
        "max_n_key": 3,
        "next_token": next_token,
    }
    drawn = jr.JointRecallSource(split, 6, **shape)
    cached = jr.JointRecallSource(split, 6, **shape, cache_dir=tmp_path)
    for index in (5, 0, 3):
        for name, value in drawn[index].items():
            assert cached[index][name].dtype == value.dtype
            np.testing.assert_array_equal(cached[index][name], value)
    files = sorted(p.name for p in tmp_path.glob("*.npz"))
    assert len(files) == 1 and files[0].startswith(f"joint_recall-{split}-")

    # Another process's source (a resumed run, eval.py) reads the file and draws nothing.
    expected = drawn[4]

    def no_draw(self, indices):
        raise AssertionError("drew an example the cache holds")

    monkeypatch.setattr(jr.JointRecallSource, "_draw_rows", no_draw)
    again = jr.JointRecallSource(split, 6, **shape, cache_dir=tmp_path)[4]
    for name, value in expected.items():
        np.testing.assert_array_equal(again[name], value)
    monkeypatch.undo()
    # Any other parameter is another split: another file.
    other = jr.JointRecallSource(split, 6, **{**shape, "seed": 8}, cache_dir=tmp_path)
    other[0]
    assert len(list(tmp_path.glob("*.npz"))) == 2


def test_the_cache_key_covers_parameters_and_code(tmp_path):
    code = tmp_path / "generator.py"
    code.write_text("x = 1\n")
    first = split_cache.key("split", {"seed": 1, "n": [2, 3]}, code)
    assert split_cache.key("split", {"n": [2, 3], "seed": 1}, code) == first  # order-free
    assert split_cache.key("split", {"seed": 2, "n": [2, 3]}, code) != first
    code.write_text("x = 2\n")
    assert split_cache.key("split", {"seed": 1, "n": [2, 3]}, code) != first
    # Every file the split's draw runs counts: a change to a helper module redraws it too.
    helper = tmp_path / "helper.py"
    helper.write_text("y = 1\n")
    both = split_cache.key("split", {"seed": 1}, code, helper)
    helper.write_text("y = 2\n")
    assert split_cache.key("split", {"seed": 1}, code, helper) != both
    with pytest.raises(ValueError, match="source files"):
        split_cache.key("split", {"seed": 1})


def test_concurrent_processes_build_a_split_once(tmp_path):
    # Eight builders at once (threads: flock locks per open file, as between processes): one
    # builds while the others wait on its lock, then all read its file.
    builds = []

    def build():
        builds.append(1)
        time.sleep(0.2)
        return {"tokens": np.arange(6, dtype=np.uint8).reshape(2, 3)}

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda _: split_cache.load_or_build("s", build, tmp_path), range(8)))
    assert len(builds) == 1
    for arrays in got:
        np.testing.assert_array_equal(arrays["tokens"], [[0, 1, 2], [3, 4, 5]])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.lock", "s.npz"]


def test_an_unwritable_cache_draws_the_split_and_says_so(tmp_path, capsys):
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    arrays = split_cache.load_or_build("s", lambda: {"x": np.arange(3)}, blocked / "cache")
    np.testing.assert_array_equal(arrays["x"], [0, 1, 2])
    assert "drawing s without keeping it (set HAX_JAX_CACHE)" in capsys.readouterr().err


def assert_uniform(codes, n_cells):
    """codes (ints in [0, n_cells)) look uniform: Pearson's chi2 within 5 sd of its mean."""
    counts = np.bincount(codes, minlength=n_cells)
    assert len(counts) == n_cells and counts.min() > 0, counts
    expected = len(codes) / n_cells
    chi2 = ((counts - expected) ** 2 / expected).sum()
    df = n_cells - 1
    assert (chi2 - df) / np.sqrt(2 * df) < 5, (chi2, df, counts)


def test_draws_are_uniform_and_independent():
    # rng.permutation per parent (the previous generator) is the draw's slow twin, but the two give
    # different examples: pin the distribution instead. An argsort of random words must give
    # uniform orders, independent between the parts, between parents and of the table (a word
    # drawn twice, e.g. shared by the parts or by the table and an order, shows up here).
    n = 18_000
    sizes, table, orders = jr.draw(
        [[5, a] for a in range(n)],
        n_context=(3, 3),
        n_key=(2, 3),
        n_value=4,
        max_n_context=3,
        max_n_key=4,
    )
    assert_uniform(sizes[:, 1] - 2, 2)
    contexts = orders[0][:, :, :3] @ [9, 3, 1]  # (n, part): the context order, 26 codes ...
    codes = np.unique(contexts, return_inverse=True)[1].reshape(n, 2)  # ... renumbered 0..5
    assert_uniform(codes[:, 0] * 6 + codes[:, 1], 36)  # information part x inquiry part
    three = sizes[:, 1] == 3  # keys' orders at n_key 3 (a padding key sorts last)
    keys = orders[1][three][..., :3] @ [9, 3, 1]  # (n3, part, context)
    keys = np.unique(keys, return_inverse=True)[1].reshape(keys.shape)
    assert_uniform(keys[:, 0, 0] * 6 + keys[:, 1, 0], 36)  # a context's keys: the two parts
    assert_uniform(keys[:, 0, 0] * 6 + keys[:, 0, 1], 36)  # two contexts' keys, one part
    assert_uniform(keys[:, 0, 0] * 6 + codes[three, 0], 36)  # a context's keys and the contexts
    assert_uniform(table[:, 0, 0] * 4 + table[:, 2, 1], 16)  # two entries of the table
    assert_uniform(table[:, 0, 0] * 6 + codes[:, 0], 24)  # an entry and the contexts' order
    assert_uniform(table[three, 0, 0] * 6 + keys[:, 1, 0], 24)  # an entry and its keys' order


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


@pytest.mark.parametrize(
    "split, next_token, cached",
    [("train", True, False), ("valid", False, False), ("test", True, True)],
)
def test_rows_are_the_examples_stacked(tmp_path, split, next_token, cached):
    shape = {"seed": 7, "n_context": (2, 4), "n_key": (1, 3), "max_n_key": 3}
    src = jr.JointRecallSource(
        split, 30, **shape, next_token=next_token, cache_dir=tmp_path if cached else None
    )
    indices = [29, 3, 3, 0, 17]  # any order, repeats allowed
    rows = src.rows(np.array(indices))
    for name, value in src[0].items():
        assert rows[name].dtype == value.dtype and rows[name].shape == (5, *value.shape)
        np.testing.assert_array_equal(rows[name], np.stack([src[i][name] for i in indices]))
    assert all(v.shape[0] == 0 for v in src.rows(np.array([], int)).values())
    with pytest.raises(IndexError, match="out of range for a .* split of 30"):
        src.rows([0, 30])


def test_pcg64_raw_words_are_numpys_own_streams():
    # The obvious twin: one np.random.PCG64 per seed (SeedSequence hashing, PCG64 seeding).
    rng = np.random.default_rng(11)
    seeds = rng.integers(0, 1 << 32, (40, 4)).tolist()
    seeds += [[0, 0, 0, 0], [(1 << 32) - 1] * 4, [7, 980, 123_456, 3]]
    # outside the vectorised form, numpy's own path: a word of 33 or 64 bits, three words
    seeds += [[1 << 32, 0, 0, 0], [1 << 64, 0, 0, 0], [1, 2, 3]]
    for group in (seeds[:-3], seeds[:3], *([s] for s in seeds[-3:])):
        want = np.stack([np.random.PCG64(s).random_raw(37) for s in group])
        np.testing.assert_array_equal(pcg64.raw_words(group, 37), want)
