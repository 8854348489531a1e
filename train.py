"""Trains a model: `python train.py [configs/<name>.py] [key=value ...]`.

The training loop (sharded, resumable, grain data, orbax checkpoints) is issue #4. Until it lands this
entry point resolves the config exactly as training will, builds the model's shapes, and prints the plan.
"""

import math
import sys

import jax
from flax import nnx

from hax_jax import config as config_lib
from hax_jax.checkpoint import abstract_model

DEFAULT_CONFIG = "configs/tiny.py"


def main(argv: list[str]) -> None:
    """Resolves the config and prints what a run of it will train."""
    path = argv[0] if argv and argv[0].endswith(".py") else DEFAULT_CONFIG
    overrides = argv[1:] if argv and argv[0].endswith(".py") else argv
    cfg = config_lib.apply_overrides(config_lib.load_config_file(path), overrides)
    params = nnx.state(abstract_model(cfg.model), nnx.Param)
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    print(f"config {path} with overrides {overrides or 'none'}:")
    print(config_lib.to_dict(cfg))
    print(
        f"model: {cfg.model.n_layer} layers {cfg.model.mixer_kinds}, {count:,} parameters, "
        f"devices: {jax.devices()}"
    )
    print(
        "training (optax AdamW, grain data, orbax checkpoints, data/seq/tensor sharding) arrives with "
        "issue #4; this run only checked the config and the model's shapes."
    )


if __name__ == "__main__":
    main(sys.argv[1:])
