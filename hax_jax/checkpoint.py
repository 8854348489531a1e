"""Pretrained-model directories: `config.json` (our ModelConfig) beside an orbax tree of parameters;
training checkpoints; and the model surgery of loading a pretrained model into a larger one."""

import math
from pathlib import Path

import grain  # also registers grain's orbax handler for data iterators
import jax
import orbax.checkpoint as ocp
from flax import nnx

from hax_jax import config as config_lib
from hax_jax.config import ModelConfig
from hax_jax.layers.hax_attention import init_qk_from_bc
from hax_jax.models.lm import LanguageModel

CONFIG_FILE = "config.json"
PARAMS_DIR = "params"
# Settings that leave the trained numbers alone (memory for compute; how much validation runs): a
# run may resume with others (remat switched on after running out of memory), or from a checkpoint
# written before they existed.
FREE_SETTINGS = ("model.remat", "model.mamba.scan_states", "model.loss_chunk", "data.eval_batches")


def abstract_model(cfg: ModelConfig) -> LanguageModel:
    """The model with shape/dtype placeholders instead of arrays (nothing is allocated)."""
    return nnx.eval_shape(lambda: LanguageModel(cfg, rngs=nnx.Rngs(0)))


def save_pretrained(model: LanguageModel, path: str | Path) -> None:
    """Writes `path/config.json` and `path/params` (orbax); `path` must not hold a checkpoint
    yet."""
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
        saved = _saved_shapes(ckptr, path / PARAMS_DIR)
        problems = _mismatches(saved, target) + [
            f"{k} is missing there" for k in _shapes(target) if k not in saved
        ]
        if problems:
            raise ValueError(
                f"{str(path)!r} does not match the model of its config.json: "
                + "; ".join(problems[:8])
                + " (checkpoints written before in_proj and conv1d were stored part by part "
                "cannot be read: convert the HF / mamba_ssm weights again)"
            )
        params = ckptr.restore(path / PARAMS_DIR, target)
    nnx.replace_by_pure_dict(abstract_state, params)
    return nnx.merge(graphdef, abstract_state)


def load_for_eval(path: str | Path) -> tuple[LanguageModel, config_lib.Config, list[Path]]:
    """A pretrained directory or a training workdir: (model, run config, tokenizer directories to
    try).

    A workdir gives its best-by-validation parameters and its whole config (data settings included);
    a pretrained directory gives the default Config around its ModelConfig.
    """
    path = Path(path).absolute()
    if (path / PARAMS_DIR).exists() or not (path / "best").exists():
        if (path / "checkpoints").exists():
            raise FileNotFoundError(
                f"workdir {str(path)!r} has no evaluated checkpoint yet "
                f"({path / 'best'} is missing); "
                "eval.py reads the best parameters, which train.py keeps from its first evaluation"
            )
        model = load_pretrained(path)
        return model, config_lib.Config(model=model.cfg), [path]
    cfg = config_lib.load_json(config_lib.Config, path / CONFIG_FILE)
    manager = best_checkpointer(path)
    step = manager.best_step()
    abstract = nnx.to_pure_dict(nnx.state(abstract_model(cfg.model), nnx.Param))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract
    )
    params = manager.restore(
        step, args=ocp.args.Composite(params=ocp.args.StandardRestore(target))
    )["params"]
    graphdef, state = nnx.split(abstract_model(cfg.model), nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    tokenizers = [Path(cfg.data.tokenizer) if cfg.data.tokenizer else None, path / "tokenizer"]
    return nnx.merge(graphdef, state), cfg, [p for p in tokenizers if p is not None]


# ----------------------------------------------------------------------------- training runs
# workdir/checkpoints/<step>/{state, data, config}: the TrainState, the data iterator (grain, one
# file per process) and the resolved config. workdir/best/<step>/ keeps the parameters of the best
# validation
# score.


def train_checkpointer(workdir: str | Path, keep: int) -> ocp.CheckpointManager:
    """The manager of a run's checkpoints: the latest `keep`, written asynchronously."""
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep,
        enable_async_checkpointing=True,
        multiprocessing_options=ocp.options.MultiprocessingOptions(barrier_sync_key_prefix="train"),
    )
    return ocp.CheckpointManager(
        Path(workdir).absolute() / "checkpoints", options=options, item_names=CHECKPOINT_ITEMS
    )


CHECKPOINT_ITEMS = ("state", "data", "config")


def best_checkpointer(workdir: str | Path) -> ocp.CheckpointManager:
    """The manager of the best parameters by validation accuracy (one kept)."""
    # Its own barrier names: saved at the same step as the train checkpoint, the two managers'
    # multi-process barriers would otherwise share a key ("_async_write_complete.<step>") and hang.
    options = ocp.CheckpointManagerOptions(
        max_to_keep=1,
        best_fn=lambda metrics: metrics["valid_accuracy"],
        best_mode="max",
        multiprocessing_options=ocp.options.MultiprocessingOptions(barrier_sync_key_prefix="best"),
    )
    return ocp.CheckpointManager(
        Path(workdir).absolute() / "best", options=options, item_names=("params", "config")
    )


def save_train(manager, step: int, state, iterator, cfg) -> None:
    """Saves the state, the iterator's position and the config at `step` (async for the state)."""
    manager.save(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=grain.checkpoint.CheckpointSave(iterator),
            config=ocp.args.JsonSave(config_lib.to_dict(cfg)),
        ),
        force=True,
    )


def saved_config(manager, step: int) -> dict:
    """The resolved config a checkpoint was written with."""
    return manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]


def check_resumable(saved: dict, cfg, where: str) -> None:
    """Raises unless the checkpoint in `where` was written for the same model and data."""
    current, saved = config_lib.to_dict(cfg), config_lib.migrate_dict(saved)
    for section in ("model", "data"):
        diffs = _diff(saved.get(section, {}), current[section], section)
        diffs = [d for d in diffs if d.partition(":")[0] not in FREE_SETTINGS]
        if diffs:
            raise ValueError(
                f"{where} holds a checkpoint of another {section} config ("
                + "; ".join(diffs[:8])
                + "); use a new workdir or the same config"
            )


def _diff(old, new, prefix: str) -> list[str]:
    """The dotted keys where two config dicts differ, with both values."""
    if isinstance(old, dict) and isinstance(new, dict):
        keys = sorted(set(old) | set(new))
        return [d for k in keys for d in _diff(old.get(k), new.get(k), f"{prefix}.{k}")]
    old = list(old) if isinstance(old, tuple) else old
    new = list(new) if isinstance(new, tuple) else new
    return [] if old == new else [f"{prefix}: checkpoint {old!r} vs now {new!r}"]


def restore_train(manager, step: int, abstract_state, iterator):
    """The state (placed as `abstract_state`'s shardings) and the iterator, both as saved at
    `step`."""
    restored = manager.restore(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state),
            data=grain.checkpoint.CheckpointRestore(iterator),
        ),
    )
    return restored["state"], restored["data"]


def restore_params(path: str | Path, target: dict) -> dict:
    """Parameters of a pretrained directory into `target` (abstract, with shardings).

    Every parameter the checkpoint has must exist in `target` with the same shape; parameters only
    `target` has (e.g. a HAX branch added to a released Mamba) keep their values from `target`'s
    init.
    """
    path = Path(path).absolute()
    if not (path / PARAMS_DIR).exists():
        raise FileNotFoundError(
            f"init_from={str(path)!r} is not a hax_jax checkpoint: {PARAMS_DIR} is missing"
        )
    with ocp.StandardCheckpointer() as ckptr:
        saved = _saved_shapes(ckptr, path / PARAMS_DIR)
        problems = _mismatches(saved, target)
        if problems:
            raise ValueError(
                f"init_from={str(path)!r} does not match the model: " + "; ".join(problems[:8])
            )
        partial = _keep_paths(target, set(saved))
        return ckptr.restore(path / PARAMS_DIR, partial)


def init_from(path: str | Path, params: dict, target: dict, model: ModelConfig) -> dict:
    """`params` (fresh) with a pretrained directory's parameters put in (`restore_params` into
    `target`, their abstract twin); a Mamba-1 layer's new HAX branch gets its q/k projection from
    the SSM's B / C."""
    loaded = restore_params(path, target)
    return _qk_from_bc(_overlay(params, loaded), loaded, model)


def _qk_from_bc(params: dict, loaded: dict, model: ModelConfig) -> dict:
    """Mamba-1 layers given a new HAX branch: its q/k projection from x_proj's C / B (HAX App.
    D.2)."""
    dt_rank = model.mamba.dt_rank or math.ceil(model.d_model / 16)
    for key, layer in params["layers"].items():
        mixer, had = layer["mixer"], loaded.get("layers", {}).get(key, {}).get("mixer", {})
        if "x_proj" in mixer and "branch" in mixer and "branch" not in had:
            mixer["branch"]["qk_proj"]["kernel"] = init_qk_from_bc(
                mixer["x_proj"]["kernel"], dt_rank=dt_rank, d_state=model.mamba.d_state
            )
    return params


def _overlay(base: dict, top: dict) -> dict:
    """`base` with the leaves of `top` (a sub-tree of it) put in."""
    out = dict(base)
    for key, value in top.items():
        out[key] = _overlay(base[key], value) if isinstance(value, dict) else value
    return out


def _saved_shapes(ckptr, directory: Path) -> dict[str, tuple]:
    """Parameter path -> shape, from a checkpoint's metadata."""
    meta = ckptr.metadata(directory)
    return _shapes(getattr(meta, "item_metadata", meta))


def _shapes(tree) -> dict[str, tuple]:
    return {_path(p): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def _mismatches(saved: dict[str, tuple], target: dict) -> list[str]:
    """What of a checkpoint's parameters (`saved`: path -> shape) the model `target` lacks or
    holds in another shape."""
    wanted = _shapes(target)
    return [f"{k} is not in the model" for k in saved if k not in wanted] + [
        f"{k} has shape {saved[k]} there, {wanted[k]} here"
        for k in saved
        if k in wanted and saved[k] != wanted[k]
    ]


def _path(path) -> str:
    """ "layers/0/mixer/A_log" for a tree path (a checkpoint's metadata has str keys, models int
    keys)."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _keep_paths(tree: dict, keep: set[str], prefix=()) -> dict:
    """The sub-dict of `tree` whose leaf paths (as keystr) are in `keep`."""
    out = {}
    for k, v in tree.items():
        path = (*prefix, jax.tree_util.DictKey(k))
        if isinstance(v, dict):
            sub = _keep_paths(v, keep, path)
            if sub:
                out[k] = sub
        elif _path(path) in keep:
            out[k] = v
    return out


def save_best(manager, step: int, params: dict, cfg, metrics: dict) -> None:
    """Offers the parameters at `step` to the best-by-validation manager (it keeps the best one)."""
    manager.save(
        step,
        args=ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            config=ocp.args.JsonSave(config_lib.to_dict(cfg.model)),
        ),
        metrics=metrics,
        force=True,
    )
