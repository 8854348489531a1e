"""The data pipeline: the task's source for a split, the training batches, the evaluation batches.

Every source yields rows in one schema, int32 arrays of the model's length L: inputs, labels (the
next tokens), loss_mask (where loss and accuracy count), real (0 = padding) and seq_idx (document
index within the row). Batches stack rows to (rows, L). Evaluation batches also carry weight
(rows,): 1 for real rows, 0 for the rows that pad the last batch (all-zero rows, real and loss_mask
included), so per-row metrics such as the joint-recall accuracy average over real rows only.
"""

import hashlib
import math
import os
from pathlib import Path

import grain
import jax
import numpy as np

from hax_jax.config import Config
from hax_jax.data import joint_recall, mqar, split_cache, text, tokens
from hax_jax.distributed import barrier, is_main

# Few threads and a short buffer: a thread makes a whole batch (64 x 1057 joint-recall rows in one
# vectorised draw), and such a batch is already 1.4 MB.
READ_OPTIONS = grain.ReadOptions(num_threads=4, prefetch_buffer_size=16)


def row_length(cfg: Config) -> int:
    """L, the model's input length: joint recall's padded length - 1, else data.seq_len."""
    if cfg.data.task == "joint_recall":
        jr = cfg.data.joint_recall
        return joint_recall.padded_length(jr.max_n_context, jr.max_n_key, jr.outer_levels) - 1
    return cfg.data.seq_len


def make_source(cfg: Config, split: str, workdir: str | Path):
    """The random-access source of cfg.data.task for split: "train", "valid" (synthetic: "test")."""
    data = cfg.data
    vocab_size = cfg.model.vocab_size
    if data.task == "joint_recall":
        jr = data.joint_recall
        return joint_recall.JointRecallSource(
            split,
            jr.train_size if split == "train" else jr.valid_size,
            seed=data.seed,
            n_context=jr.n_context,
            n_key=jr.n_key,
            n_value=jr.n_value,
            max_n_context=jr.max_n_context,
            max_n_key=jr.max_n_key,
            outer_levels=jr.outer_levels,
            vocab_size=vocab_size,
            next_token=True,
            # valid and test are drawn by rejection: once per machine, not per process
            cache_dir=None if split == "train" else split_cache.directory(),
        )
    if data.task == "mqar":
        mq = data.mqar
        args = {"seq_len": data.seq_len, "vocab_size": vocab_size, "random_fill": mq.random_fill}
        if split == "train":
            return mqar.MqarCurriculumSource(
                stages=mq.curriculum or (mq.num_kv_pairs,),
                stage_examples=mq.stage_examples,
                stage_epochs=mq.stage_epochs,
                seed=data.seed,
                **args,
            )
        return mqar.MqarSource(
            split, mq.valid_size, num_kv_pairs=mq.num_kv_pairs, seed=data.seed, **args
        )
    if data.task == "tokens":
        path, valid_path, dtype = data.path, data.valid_path, data.token_dtype
    else:  # text: tokenize once into workdir, then read it as a token file
        path, valid_path = text_token_files(cfg, workdir)
        dtype = "uint16"  # unused: .npy files carry their dtype
    if not path:
        raise ValueError(f"data.task={data.task!r} needs data.path")
    return tokens.token_source(
        path,
        split,
        seq_len=data.seq_len,
        vocab_size=vocab_size,
        eos_id=data.eos_id,
        dtype=dtype,
        valid_path=valid_path,
        valid_fraction=data.valid_fraction,
    )


def text_token_files(cfg: Config, workdir: str | Path) -> tuple[str, str]:
    """(train, valid) .npy token files of the text task, tokenized into workdir/tokens once.

    With data.tokenizer = "", a BPE of model.vocab_size is trained on data.path into
    workdir/tokenizer (once). The cache key covers the text file's path, size and mtime, the
    tokenizer and eos_id.
    """
    data = cfg.data
    if not data.path:
        raise ValueError("data.task='text' needs data.path (a UTF-8 text file)")
    tokenizer_dir = Path(data.tokenizer or Path(workdir) / "tokenizer")
    # One process trains the tokenizer and tokenizes; the others wait, then read its files (the
    # barriers are unconditional: every process must reach each of them).
    if is_main() and not data.tokenizer and not (tokenizer_dir / "tokenizer.json").is_file():
        text.train_tokenizer([data.path], tokenizer_dir, cfg.model.vocab_size)
    barrier("tokenizer")
    tokenizer = text.load_tokenizer(tokenizer_dir)
    text.check_vocab(tokenizer, cfg.model.vocab_size)
    vocab_key = (tokenizer_dir / "tokenizer.json").read_bytes()
    out = []
    for path in (data.path, data.valid_path):
        if not path:
            out.append("")
            continue
        if not Path(path).is_file():
            raise FileNotFoundError(f"text file {path!r} does not exist")
        stat = Path(path).stat()
        key = f"{Path(path).resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{data.eos_id}".encode()
        digest = hashlib.blake2b(key + vocab_key, digest_size=8).hexdigest()
        cached = Path(workdir) / "tokens" / f"{Path(path).stem}-{digest}.npy"
        if is_main() and not cached.is_file():
            # Write then rename: a reader (another run) never sees half a file.
            partial = cached.with_name(f"{cached.stem}.{os.getpid()}.partial.npy")
            text.tokenize_file(path, tokenizer, partial, data.eos_id)
            os.replace(partial, cached)
        barrier(f"tokens {cached.name}")
        out.append(str(cached))
    return out[0], out[1]


def default_rows(batch_size: int) -> tuple[int, int]:
    """Rows [start, stop) of each global batch this process reads when no mesh says otherwise:
    all of them in one process, else its contiguous equal share (an error unless that divides)."""
    count = jax.process_count()
    if batch_size % count:
        raise ValueError(
            f"data.batch_size={batch_size} must be a multiple of jax.process_count()={count}"
        )
    share = batch_size // count
    return jax.process_index() * share, (jax.process_index() + 1) * share


def train_dataset(
    cfg: Config, workdir: str | Path, rows: tuple[int, int] | None = None
) -> grain.IterDataset:
    """Endless training batches of this process, a checkpointable grain IterDataset.

    The source's indices -> shuffle (not mqar: its curriculum order is the schedule) -> repeat:
    the global batch b is rows [b B, (b + 1) B) of that stream (B = data.batch_size), and this
    process reads its `rows` [start, stop) of every global batch (sharding.process_rows;
    default_rows without a mesh), a batch of indices at a time (`rows_reader`). Processes holding
    the same rows read the same ones. Iterator state = batches consumed, so `get_state` /
    `set_state` (or grain.checkpoint.CheckpointSave/Restore) resume at the next batch.
    """
    batch_size = cfg.data.batch_size
    start, stop = rows or default_rows(batch_size)
    source = make_source(cfg, "train", workdir)
    order = grain.MapDataset.range(len(source))  # the source's indices, in the order read
    if cfg.data.task != "mqar":
        order = order.shuffle(seed=cfg.data.seed)  # a fresh permutation every epoch
    stream = order.repeat(None)
    count = stop - start
    # Row k of this process: row start + k % count of global batch k // count.
    mine = grain.MapDataset.range(len(stream) // batch_size * count).map(
        lambda k: stream[k // count * batch_size + start + k % count]
    )
    return (
        mine.batch(count, drop_remainder=True)
        .map(rows_reader(source))
        .to_iter_dataset(READ_OPTIONS)
    )


def rows_reader(source):
    """indices -> the source's examples at them, stacked: the source's own vectorised `rows`
    where it has one (joint recall: one draw for a batch), else one example at a time."""
    if hasattr(source, "rows"):
        return source.rows

    def read(indices) -> dict[str, np.ndarray]:
        examples = [source[int(i)] for i in indices]
        if not examples:  # a process's share of the last evaluation batch can be empty
            return {k: np.zeros((0, *v.shape), v.dtype) for k, v in source[0].items()}
        return {k: np.stack([e[k] for e in examples]) for k in examples[0]}

    return read


def eval_batches(
    cfg: Config,
    workdir: str | Path,
    split: str = "valid",
    max_batches: int = 0,
    rows: tuple[int, int] | None = None,
):
    """This process's evaluation batches of `split`, in order, each example exactly once.

    Global batch b holds examples [b B, (b + 1) B); the process takes its `rows` [start, stop) of
    it (as train_dataset). The last batch is padded with weight-0 rows, so every process yields the
    same number of batches of the same shape. max_batches > 0 stops after that many.
    """
    source = make_source(cfg, split, workdir)
    batch_size = cfg.data.batch_size
    first, stop = rows or default_rows(batch_size)
    count = stop - first
    n_batches = math.ceil(len(source) / batch_size)
    if max_batches > 0:
        n_batches = min(n_batches, max_batches)
    read = rows_reader(source)

    def make_batch(b: int) -> dict[str, np.ndarray]:
        """Global batch b's rows of this process, padded to `count` with all-zero rows."""
        start = min(b * batch_size + first, len(source))
        real = read(np.arange(start, min(start + count, len(source))))
        n = len(real["inputs"])
        weight = np.zeros(count, np.int32)
        weight[:n] = 1
        pad = {k: np.zeros((count - n, *v.shape[1:]), v.dtype) for k, v in real.items()}
        batch = {k: np.concatenate([v, pad[k]]) for k, v in real.items()}
        return {**batch, "weight": weight}

    yield from grain.MapDataset.range(n_batches).map(make_batch).to_iter_dataset(READ_OPTIONS)
