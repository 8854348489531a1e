"""The pipeline: sources per task, resumable training batches, process shards, padded eval."""

import dataclasses

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from hax_jax.config import (
    Config,
    DataConfig,
    JointRecallConfig,
    ModelConfig,
    MqarConfig,
)
from hax_jax.data import joint_recall, mqar, pipeline, text

FIELDS = {"inputs", "labels", "loss_mask", "real", "seq_idx"}
SMALL_JR = JointRecallConfig(
    n_context=(2, 3), n_key=(2, 3), max_n_context=3, max_n_key=3, train_size=40, valid_size=10
)  # rows of length 2 * 3 * 7 + 2 - 1 = 43


def make_cfg(task="joint_recall", vocab_size=100, **data) -> Config:
    """A small config of `task`."""
    data = DataConfig(task=task, batch_size=4, joint_recall=SMALL_JR, **data)
    return Config(model=ModelConfig(vocab_size=vocab_size), data=data)


def take(iterator, n):
    """The next n batches."""
    return [next(iterator) for _ in range(n)]


def assert_same_batches(a, b):
    """Lists of batches are equal field by field."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])


def test_train_batches_shape_and_resume_from_state(tmp_path):
    ds = pipeline.train_dataset(make_cfg(), tmp_path)
    it = iter(ds)
    first = take(it, 3)
    assert set(first[0]) == FIELDS
    assert all(v.shape == (4, 43) and v.dtype == np.int32 for v in first[0].values())
    assert pipeline.row_length(make_cfg()) == 43
    state = it.get_state()
    expected = take(it, 12)  # crosses the end of the 40-row epoch
    resumed = iter(ds)
    resumed.set_state(state)
    assert_same_batches(take(resumed, 12), expected)
    assert_same_batches(take(iter(pipeline.train_dataset(make_cfg(), tmp_path)), 3), first)
    # Shuffled: the first batch is not the source's first rows; epochs differ in order.
    src = pipeline.make_source(make_cfg(), "train", tmp_path)
    assert not np.array_equal(first[0]["inputs"], np.stack([src[i]["inputs"] for i in range(4)]))
    epoch0 = np.concatenate([b["inputs"] for b in first + expected[:7]])
    epoch1 = np.concatenate([b["inputs"] for b in expected[7:12]])
    assert sorted(map(bytes, epoch0)) == sorted(bytes(src[i]["inputs"]) for i in range(40))
    assert not np.array_equal(epoch0[:20], epoch1)


def test_resume_through_an_orbax_checkpoint(tmp_path):
    ds = pipeline.train_dataset(make_cfg(), tmp_path)
    it = iter(ds)
    take(it, 2)
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.save(2, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
        manager.wait_until_finished()
    expected = take(it, 3)
    restored = iter(ds)
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.restore(
            2, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(restored))
        )
    assert_same_batches(take(restored, 3), expected)


def test_processes_share_the_global_batch(tmp_path, monkeypatch):
    cfg = make_cfg()
    whole = take(iter(pipeline.train_dataset(cfg, tmp_path)), 2)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    parts = []
    for p in range(2):
        monkeypatch.setattr(jax, "process_index", lambda p=p: p)
        parts.append(take(iter(pipeline.train_dataset(cfg, tmp_path)), 2))
    # By default each process reads its contiguous half of every global batch.
    for b in range(2):
        assert parts[0][b]["inputs"].shape == (2, 43)
        halves = np.concatenate([parts[0][b]["inputs"], parts[1][b]["inputs"]])
        np.testing.assert_array_equal(halves, whole[b]["inputs"])
    # Rows from the mesh: processes that hold the same rows (or all of them) read the same ones.
    middle = take(iter(pipeline.train_dataset(cfg, tmp_path, rows=(1, 3))), 2)
    every = take(iter(pipeline.train_dataset(cfg, tmp_path, rows=(0, 4))), 2)
    for b in range(2):
        np.testing.assert_array_equal(middle[b]["inputs"], whole[b]["inputs"][1:3])
        np.testing.assert_array_equal(every[b]["inputs"], whole[b]["inputs"])
    with pytest.raises(ValueError, match="batch_size=3 must be a multiple of jax.process_count"):
        pipeline.train_dataset(
            dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, batch_size=3)), tmp_path
        )


def test_eval_batches_cover_every_example_once_with_padding(tmp_path, monkeypatch):
    cfg = make_cfg()  # 10 valid examples in batches of 4: 4 + 4 + 2 real rows
    src = pipeline.make_source(cfg, "valid", tmp_path)
    batches = list(pipeline.eval_batches(cfg, tmp_path))
    assert [b["weight"].tolist() for b in batches] == [[1] * 4, [1] * 4, [1, 1, 0, 0]]
    rows = np.concatenate([b["inputs"] for b in batches])[:10]
    np.testing.assert_array_equal(rows, np.stack([src[i]["inputs"] for i in range(10)]))
    last = batches[-1]
    assert not last["loss_mask"][2:].any() and not last["real"][2:].any()
    assert len(list(pipeline.eval_batches(cfg, tmp_path, max_batches=2))) == 2
    # Two processes: the same number of batches each, together every example once.
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    shares = []
    for p in range(2):
        monkeypatch.setattr(jax, "process_index", lambda p=p: p)
        shares.append(list(pipeline.eval_batches(cfg, tmp_path)))
    assert [len(s) for s in shares] == [3, 3]
    assert [b["weight"].tolist() for b in shares[1]] == [[1, 1], [1, 1], [0, 0]]
    joined = np.concatenate(
        [np.concatenate([shares[0][b]["inputs"], shares[1][b]["inputs"]]) for b in range(3)]
    )
    np.testing.assert_array_equal(joined[:10], rows)


def test_mqar_keeps_the_curriculum_order(tmp_path):
    mq = MqarConfig(
        num_kv_pairs=4, curriculum=(2, 4), stage_examples=4, stage_epochs=2, valid_size=6
    )
    cfg = make_cfg("mqar", vocab_size=64, seq_len=32, mqar=mq)
    src = pipeline.make_source(cfg, "train", tmp_path)
    assert isinstance(src, mqar.MqarCurriculumSource) and len(src) == 16
    batches = take(iter(pipeline.train_dataset(cfg, tmp_path)), 5)
    assert batches[0]["inputs"].shape == (4, pipeline.row_length(cfg)) == (4, 32)
    expected = np.stack([src[i % 16]["inputs"] for i in range(20)])
    np.testing.assert_array_equal(np.concatenate([b["inputs"] for b in batches]), expected)
    assert batches[0]["loss_mask"].sum() == 4 * 2 and batches[3]["loss_mask"].sum() == 4 * 4
    valid = list(pipeline.eval_batches(cfg, tmp_path))
    assert len(valid) == 2 and valid[0]["loss_mask"].sum() == 4 * 4
    with pytest.raises(ValueError, match="vocab_size=8 is too small"):
        pipeline.make_source(make_cfg("mqar", vocab_size=8, seq_len=32, mqar=mq), "train", tmp_path)


def test_multi_level_joint_recall_source(tmp_path):
    jr = dataclasses.replace(SMALL_JR, outer_levels=(2,))
    cfg = Config(
        model=ModelConfig(vocab_size=100),
        data=DataConfig(batch_size=4, joint_recall=jr),
    )
    row = pipeline.make_source(cfg, "valid", tmp_path)[0]
    assert row["inputs"].shape == (joint_recall.padded_length(3, 3, (2,)) - 1,)
    assert pipeline.row_length(cfg) == 2 * 2 * 3 * 7 + 2 * 2 + 2 - 1
    with pytest.raises(ValueError, match="reach 33 .*vocab_size=33 is too small"):
        pipeline.make_source(
            dataclasses.replace(cfg, model=ModelConfig(vocab_size=33)), "train", tmp_path
        )


def test_token_and_text_tasks(tmp_path):
    stream = np.arange(1, 200, dtype=np.uint16) % 50
    stream.tofile(tmp_path / "t.bin")
    cfg = make_cfg(
        "tokens", vocab_size=50, seq_len=8, path=str(tmp_path / "t.bin"), valid_fraction=0.2
    )
    train, valid = (pipeline.make_source(cfg, s, tmp_path) for s in ("train", "valid"))
    assert (len(train), len(valid)) == (19, 5)  # 198 // 8 = 24 rows, 4.8 rounded held out
    assert next(iter(pipeline.train_dataset(cfg, tmp_path)))["inputs"].shape == (4, 8)
    # Text: a BPE is trained into workdir/tokenizer, the tokens cached in workdir/tokens.
    corpus = text.write_pydoc_topics(tmp_path / "pydoc.txt")
    cfg = make_cfg("text", vocab_size=300, seq_len=64, path=str(corpus))
    work = tmp_path / "work"
    src = pipeline.make_source(cfg, "train", work)
    assert (work / "tokenizer" / "tokenizer.json").is_file()
    (cached,) = (work / "tokens").glob("*.npy")
    stamp = cached.stat().st_mtime_ns
    valid = pipeline.make_source(cfg, "valid", work)
    assert cached.stat().st_mtime_ns == stamp and len(src) > 50 * len(valid) > 0
    assert src[0]["inputs"].max() < 300 and src[0]["seq_idx"][-1] > 0
    with pytest.raises(ValueError, match="the tokenizer has 300 tokens but model.vocab_size=280"):
        pipeline.make_source(
            dataclasses.replace(cfg, model=ModelConfig(vocab_size=280)), "train", work
        )
    with pytest.raises(ValueError, match="needs data.path"):
        pipeline.make_source(make_cfg("tokens"), "train", tmp_path)


def test_train_batches_are_the_shuffled_sources_rows(tmp_path):
    # The obvious twin of the batched pipeline (a draw a batch): the source's examples one at a
    # time, in the order of grain's shuffle of the whole source, stacked B at a time.
    cfg = make_cfg(seed=3)
    examples = grain.MapDataset.source(pipeline.make_source(cfg, "train", tmp_path))
    examples = examples.shuffle(seed=3).repeat(None)
    got = take(iter(pipeline.train_dataset(cfg, tmp_path)), 12)  # past the 40-row epoch
    for b, batch in enumerate(got):
        rows = [examples[4 * b + r] for r in range(4)]
        for name in FIELDS:
            assert batch[name].dtype == rows[0][name].dtype
            np.testing.assert_array_equal(batch[name], np.stack([row[name] for row in rows]))
