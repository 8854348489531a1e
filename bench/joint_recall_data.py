"""Joint-recall data speed on this CPU: the source's train examples/s, ms per valid example, and the
grain training pipeline's rows/s (4 read threads, batches of 64 rows of 1057 tokens); with
--split-cache, the seconds train.py's evaluation takes to get the grid's 14,400 valid examples when
drawing them into an empty split cache and when reading them back from it.

    python bench/joint_recall_data.py [--seconds 5] [--no-pipeline] [--split-cache]

Default grid settings: n_context, n_key uniform in [5, 16], max 16. The Mamba-2 grid step runs about
3.8 M tokens/s, ~3,600 rows/s: the pipeline's rows/s should stay above that.
"""

import argparse
import os
import tempfile
import time

from hax_jax.config import Config, DataConfig
from hax_jax.data import joint_recall, pipeline


def rate(fn, seconds: float) -> float:
    """Calls of fn(i), i = 0, 1, ..., per second over about `seconds` (after one warm-up call)."""
    fn(0)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        count += 1
        fn(count)
    return count / (time.perf_counter() - start)


def main() -> None:
    """Prints the three rates."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="time per measurement")
    parser.add_argument("--no-pipeline", action="store_true", help="skip the grain pipeline")
    parser.add_argument(
        "--split-cache", action="store_true", help="time the valid split drawn, then cached"
    )
    args = parser.parse_args()
    size = 1_440_000
    stride = 7919  # a prime: scattered indices, as the shuffled pipeline reads them
    train = joint_recall.JointRecallSource("train", size, next_token=True)
    valid = joint_recall.JointRecallSource("valid", size, next_token=True)
    train_rate = rate(lambda i: train[i * stride % size], args.seconds)
    valid_rate = rate(lambda i: valid[i * stride % size], args.seconds)
    print(f"train source: {train_rate:,.0f} examples/s (one thread)")
    print(f"valid source: {1e3 / valid_rate:.2f} ms/example (one thread)")
    if not args.no_pipeline:
        cfg = Config(data=DataConfig(batch_size=64))
        batches = iter(pipeline.train_dataset(cfg, "/tmp/unused"))
        rows = rate(lambda i: next(batches), args.seconds) * 64
        print(f"train pipeline: {rows:,.0f} rows/s = {rows * 1057 / 1e6:.2f} M tokens/s")
    if args.split_cache:
        cfg = Config(data=DataConfig(batch_size=64))
        with tempfile.TemporaryDirectory() as empty:
            os.environ["HAX_JAX_CACHE"] = empty
            for state in ("drawn into the empty cache", "read from the cache"):
                start = time.perf_counter()
                batches = list(pipeline.eval_batches(cfg, "", "valid"))
                seconds = time.perf_counter() - start
                print(f"valid split ({len(batches)} batches of 64), {state}: {seconds:.1f} s")


if __name__ == "__main__":
    main()
