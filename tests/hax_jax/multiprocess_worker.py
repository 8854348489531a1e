"""One process of a multi-process test run: `python multiprocess_worker.py OUT STEPS [key=value
...]`.

Started like train.py (the JAX_* variables of hax_jax.distributed), it builds train.py's Trainer,
runs STEPS steps and after each writes, per parameter shard this process holds, a checksum (the
sum and the sum of squares, float64) keyed by the parameter's path and the shard's global index,
to OUT/checksums-<process>.json, so a test can compare the replicas that different processes hold.
"""

import importlib.util
import json
import sys
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT))

from hax_jax import distributed  # noqa: E402

_spec = importlib.util.spec_from_file_location("train_script", ROOT / "train.py")
train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train)


def checksums(params) -> dict[str, list[float]]:
    """(sum, sum of squares) of every shard this process holds, by 'path@index'."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        for shard in leaf.addressable_shards:
            data = np.asarray(shard.data, np.float64)
            index = ",".join(f"{s.start}:{s.stop}" for s in shard.index)
            out[f"{jax.tree_util.keystr(path)}@{index}"] = [data.sum(), (data**2).sum()]
    return out


def main(out: str, steps: int, argv: list[str]) -> None:
    distributed.initialize()
    cfg = train.resolve_config(argv)
    workdir = Path(cfg.workdir).absolute()
    mesh = train.sharding.make_mesh(cfg.mesh)
    history = []
    with jax.set_mesh(mesh):
        trainer = train.Trainer(cfg, workdir, mesh)
        state = trainer.state
        for _ in range(steps):
            state, _ = trainer.step_fn(state, trainer.batch(next(trainer.iterator)))
            history.append(checksums(state.params))
    path = Path(out) / f"checksums-{jax.process_index()}.json"
    path.write_text(json.dumps({"rows": list(trainer.rows), "steps": history}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
