"""Pretrained-model directories: `config.json` (our ModelConfig) beside an orbax tree of parameters."""

from pathlib import Path

import jax
import orbax.checkpoint as ocp
from flax import nnx

from hax_jax import config as config_lib
from hax_jax.config import ModelConfig
from hax_jax.models.lm import LanguageModel

CONFIG_FILE = "config.json"
PARAMS_DIR = "params"


def abstract_model(cfg: ModelConfig) -> LanguageModel:
    """The model with shape/dtype placeholders instead of arrays (nothing is allocated)."""
    return nnx.eval_shape(lambda: LanguageModel(cfg, rngs=nnx.Rngs(0)))


def save_pretrained(model: LanguageModel, path: str | Path) -> None:
    """Writes `path/config.json` and `path/params` (orbax); `path` must not hold a checkpoint yet."""
    path = Path(path).absolute()
    if (path / PARAMS_DIR).exists():
        raise FileExistsError(
            f"{str(path / PARAMS_DIR)!r} already exists; choose a new output directory"
        )
    path.mkdir(parents=True, exist_ok=True)
    config_lib.save_json(model.cfg, path / CONFIG_FILE)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path / PARAMS_DIR, params)


def load_pretrained(path: str | Path, *, dtype: str | None = None) -> LanguageModel:
    """Reads a directory written by `save_pretrained` (or `python -m hax_jax.convert`).

    Args:
      path: the directory holding config.json and params/.
      dtype: optional compute dtype override ("float32", "bfloat16"); parameters stay fp32.

    Returns:
      The LanguageModel; `model(tokens)` gives logits (b, l, padded vocab).
    """
    path = Path(path).absolute()
    for needed in (CONFIG_FILE, PARAMS_DIR):
        if not (path / needed).exists():
            raise FileNotFoundError(
                f"{str(path)!r} is not a hax_jax checkpoint: {needed} is missing"
            )
    cfg = config_lib.load_json(ModelConfig, path / CONFIG_FILE)
    if dtype is not None:
        cfg = config_lib.apply_overrides(cfg, [f"dtype={dtype}"])
    model = abstract_model(cfg)
    graphdef, abstract_state = nnx.split(model, nnx.Param)
    # An explicit sharding: a checkpoint written on another platform (CPU -> GPU) restores here.
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
        nnx.to_pure_dict(abstract_state),
    )
    with ocp.StandardCheckpointer() as ckptr:
        params = ckptr.restore(path / PARAMS_DIR, target)
    nnx.replace_by_pure_dict(abstract_state, params)
    return nnx.merge(graphdef, abstract_state)
