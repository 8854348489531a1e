"""The pure parts of training: the state, the loss, one optimizer step, one evaluation step.

Only pytrees of arrays cross `jit`: parameters travel as a pure dict and are merged with the model's
static graphdef inside the step. A run's fresh (or `init_from`) parameters and its state's shardings
are here too; I/O, logging and the loop live in train.py.
"""

import collections
import math
import re
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hax_jax import checkpoint, gather, optim, sharding
from hax_jax import config as config_lib
from hax_jax.loss import chunk_count, token_nll_chunked, weighted_nll
from hax_jax.models.lm import LanguageModel, rank_loss_sum


@flax.struct.dataclass
class TrainState:
    """Everything a step updates; saved whole in every checkpoint."""

    step: jax.Array  # int32 (): optimizer steps taken
    params: dict  # fp32 parameters, nnx.to_pure_dict layout
    opt_state: Any  # the optax state
    rng: jax.Array  # uint32 key data; step t trains with fold_in(rng, t)
    healthy: jax.Array  # bool (): False once a loss or gradient was not finite; no update after


def init_state(params: dict, tx: optax.GradientTransformation, seed: int) -> TrainState:
    """The state before the first step."""
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=tx.init(params),
        rng=jax.random.key_data(jax.random.key(seed)),
        healthy=jnp.ones((), bool),
    )


def per_sample_accuracy(predictions: jax.Array, batch: dict) -> tuple[jax.Array, jax.Array]:
    """(accuracy of each row's `predictions` (b, l) over its loss_mask, whether it has any)."""
    mask = batch["loss_mask"].astype(bool)
    hits = (predictions == batch["labels"]) & mask
    counts = mask.sum(-1)
    return hits.sum(-1) / jnp.maximum(counts, 1), counts > 0


def _hidden(model: LanguageModel, batch: dict, rng=None) -> tuple[jax.Array, int]:
    """(the final hidden states (b, l, d) of the batch's inputs, the loss's chunks a row)."""
    h, _ = model.hidden(
        batch["inputs"], seq_idx=batch.get("seq_idx"), mask=batch["real"].astype(bool), rng=rng
    )
    return h, chunk_count((*h.shape[:2], model.cfg.padded_vocab_size), model.cfg.loss_chunk)


def token_stats(model: LanguageModel, batch: dict, rng=None) -> tuple[jax.Array, jax.Array]:
    """(cross-entropy, argmax) at every position (b, l), the logits a chunk at a time (loss.py)."""
    h, n_chunks = _hidden(model, batch, rng)
    return token_nll_chunked(h, batch["labels"], model.head, n_chunks)


def loss_fn(params: dict, graphdef, batch: dict, rng: jax.Array, rank_loss_weight: float):
    """Task loss (mean NLL over loss_mask positions) + alpha * the layers' ranking losses.

    The NLL by `weighted_nll`: the head's gradient taken with its logits, a chunk at a time."""
    model = nnx.merge(graphdef, params)
    (h, n_chunks), sown = nnx.capture(_hidden, nnx.Intermediate)(model, batch, rng)
    mask = batch["loss_mask"].astype(jnp.float32)
    task, predictions = weighted_nll(
        h,
        batch["labels"],
        mask / jnp.maximum(mask.sum(), 1.0),
        *model.head_function(),
        n_chunks,
    )
    rank = rank_loss_sum(sown)
    accuracy, has = per_sample_accuracy(predictions, batch)
    metrics = {
        "task_loss": task,
        "rank_loss": rank,
        "accuracy": jnp.sum(accuracy * has) / jnp.maximum(has.sum(), 1),
    }
    return task + rank_loss_weight * rank, metrics


def train_step(
    state: TrainState,
    batch: dict,
    *,
    graphdef,
    tx: optax.GradientTransformation,
    rank_loss_weight: float,
    lr: optax.Schedule,
    update_shardings: dict | None = None,
    use_shardings: dict | None = None,
    compute_dtype: str = "float32",
):
    """One AdamW step; a non-finite loss or gradient leaves the state as it was and unhealthy.

    Its metrics include `lr`, the value of `tx`'s schedule `lr` at this update, computed here: in
    train.py's loop it would be a small program of its own, queued on the device behind the next
    step, so reading it would stall the loop (which reads a step's metrics after dispatching the
    next).

    `update_shardings` (mesh.shard_optimizer; those of the AdamW moments) split the gradients
    before the update, so each device updates only its slice of the parameters, and the state's
    out_shardings gather them whole (unless they rest split: `use_shardings`). XLA may then
    reduce the gradients by reduce-scatter (the GPU backend does for FSDP's same pattern; the CPU
    backend all-reduces and slices).

    `use_shardings` (mesh.param_gather="use"): the state's parameters rest split as the update's
    and are gathered to these for the loss first, so the gather opens the step instead of ending it;
    those the model reads only cast to `compute_dtype` (the model's) are gathered cast (gather.py).
    """
    rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    params = state.params
    if use_shardings is not None:
        castable = jax.tree.map(lambda _: False, params)
        if jnp.dtype(compute_dtype) != jnp.float32:
            castable = gather.cast_at_every_use(
                lambda p, b, r: loss_fn(p, graphdef, b, r, rank_loss_weight),
                (params, batch, rng),
                compute_dtype,
            )[0]
        params = gather.gathered(params, update_shardings, use_shardings, castable, compute_dtype)
    (loss, metrics), grads = grad_fn(params, graphdef, batch, rng, rank_loss_weight)
    if update_shardings is not None:
        grads = jax.lax.with_sharding_constraint(grads, update_shardings)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    grad_norm = optax.tree.norm(grads)
    healthy = state.healthy & jnp.isfinite(loss) & jnp.isfinite(grad_norm)

    def keep(new, old):
        """`new` where the step was healthy, else `old` (leaf by leaf)."""
        return jax.tree.map(lambda n, o: jnp.where(healthy, n, o), new, old)

    new_state = state.replace(
        step=state.step + healthy.astype(jnp.int32),
        params=keep(params, state.params),
        opt_state=keep(opt_state, state.opt_state),
        healthy=healthy,
    )
    return new_state, {**metrics, "loss": loss, "grad_norm": grad_norm, "lr": lr(state.step)}


def eval_step(params: dict, batch: dict, *, graphdef) -> dict:
    """Sums over the batch (rows with weight 0 are padding): per-row accuracy, rows, NLL, hits,
    tokens."""
    nll, predictions = token_stats(nnx.merge(graphdef, params), batch)
    weight = batch["weight"].astype(jnp.float32)
    accuracy, has = per_sample_accuracy(predictions, batch)
    rows = has * weight
    mask = batch["loss_mask"].astype(jnp.float32) * weight[:, None]
    hits = (predictions == batch["labels"]).astype(jnp.float32)
    return {
        "accuracy_sum": jnp.sum(accuracy * rows),
        "rows": jnp.sum(rows),
        "nll_sum": jnp.sum(nll * mask),
        "hits": jnp.sum(hits * mask),  # token accuracy = hits / tokens (Zoology's MQAR metric)
        "tokens": jnp.sum(mask),
    }


# ----------------------------------------------------------------------------- a run's start


def init_params(cfg: config_lib.Config, graphdef, shardings: dict) -> dict:
    """Fresh parameters, created directly in their shardings; then `init_from` loaded over them."""
    params = jax.jit(
        lambda: nnx.to_pure_dict(
            nnx.state(LanguageModel(cfg.model, rngs=nnx.Rngs(cfg.seed)), nnx.Param)
        ),
        out_shardings=shardings,
    )()
    if not cfg.train.init_from:
        return params
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params
    )
    return checkpoint.init_from(cfg.train.init_from, params, target, cfg.model)


class ParamShardings(NamedTuple):
    """The parameters' shardings (pure dicts), each checked to split what it is asked to."""

    use: dict  # in the loss
    update: dict | None  # of the update and the AdamW moments where they differ (shard_optimizer)
    rest: dict  # in the state between steps: `update` under mesh.param_gather="use", else `use`

    @property
    def gathered(self) -> dict | None:
        """What the step gathers the resting parameters to before the loss (`use`), or None
        where they rest as the loss uses them."""
        return None if self.rest is self.use else self.use


def param_shardings(abstract_params, mesh, mesh_cfg) -> ParamShardings:
    """The parameters' shardings under `mesh_cfg`. Under mesh.shard_optimizer without FSDP the
    update splits the parameters' d_model axis ("embed") over "data" and "seq" (OPTIMIZER_RULES),
    as FSDP splits parameters; mesh.param_gather="use" keeps them so split between steps, and is
    refused without that split."""
    if mesh_cfg.param_gather == "use" and (mesh_cfg.fsdp or not mesh_cfg.shard_optimizer):
        raise ValueError(
            "mesh.param_gather='use' gathers the parameters that mesh.shard_optimizer splits: it "
            "needs mesh.shard_optimizer=true and mesh.fsdp=false (fsdp gathers each parameter "
            f"where it is used), got mesh.shard_optimizer={str(mesh_cfg.shard_optimizer).lower()}, "
            f"mesh.fsdp={str(mesh_cfg.fsdp).lower()}"
        )
    use = _checked_shardings(abstract_params, mesh, sharding.rules(fsdp=mesh_cfg.fsdp))
    if mesh_cfg.fsdp or not mesh_cfg.shard_optimizer:
        return ParamShardings(use, None, use)
    update = _checked_shardings(abstract_params, mesh, sharding.OPTIMIZER_RULES)
    return ParamShardings(use, update, update if mesh_cfg.param_gather == "use" else use)


def _checked_shardings(abstract_params, mesh, rules: sharding.Rules) -> dict:
    """The parameters' shardings under `rules`, as a pure dict."""
    sharding.check_param_splits(abstract_params, mesh, rules)
    return sharding.param_shardings_dict(abstract_params, mesh, rules)


# XLA:GPU joins collectives of each kind while the joined size stays within these many bytes: at
# 1 none join. The gradients' reductions are all-reduces, or reduce-scatters with fsdp and
# shard_optimizer, which also gather parameters.
_COMBINE_THRESHOLDS = (
    "xla_gpu_all_reduce_combine_threshold_bytes",
    "xla_gpu_reduce_scatter_combine_threshold_bytes",
    "xla_gpu_all_gather_combine_threshold_bytes",
)


def step_compiler_options(mesh_cfg, mesh, abstract_params=None, param_shardings=None) -> dict:
    """XLA options for compiling the train step on `mesh`, from mesh.combine_collectives (see
    config.MeshConfig): {} keeps XLA's defaults. "block" reads the parameters' shapes and
    shardings for the largest block's gradient bytes on a device (`largest_block_bytes`)."""
    combine = mesh_cfg.combine_collectives
    platform = mesh.devices.flat[0].platform
    if combine in ("off", "block") and platform != "gpu":
        raise ValueError(
            f"mesh.combine_collectives={combine!r} is an XLA:GPU setting; this mesh's devices are "
            f"{platform}"
        )
    if combine == "on" or platform != "gpu" or (combine == "auto" and mesh.shape["seq"] == 1):
        return {}
    threshold = 1
    if combine in ("auto", "block"):
        threshold = largest_block_bytes(abstract_params, param_shardings)
        if threshold < 1:
            raise ValueError(f"mesh.combine_collectives={combine!r} needs a model with blocks")
    return dict.fromkeys(_COMBINE_THRESHOLDS, threshold)


def largest_block_bytes(abstract_params, param_shardings: dict) -> int:
    """Bytes of the largest residual block's parameters on one device as "tensor" splits them
    (fsdp's split follows the reduction over "data" and "seq"), in the parameters' dtype; 0
    without blocks. A bf16 model's projection kernels are read only cast, and their gradients
    are summed in bf16 (half these bytes), so a joined sum holds up to about two blocks'."""
    per_block = collections.Counter()

    def add(path, leaf, named):
        if path[0].key == "layers":
            tensor = {"tensor": named.mesh.shape.get("tensor", 1)}
            shard = [
                size // math.prod(tensor[a] for a in sharding.split_axes(entry, tensor))
                for size, entry in zip(leaf.shape, _padded(named.spec, leaf.ndim))
            ]
            per_block[path[1].key] += math.prod(shard) * jnp.dtype(leaf.dtype).itemsize

    jax.tree_util.tree_map_with_path(add, nnx.to_pure_dict(abstract_params), param_shardings)
    return max(per_block.values(), default=0)


def _padded(spec, ndim: int) -> tuple:
    """A PartitionSpec's entries for all `ndim` dimensions (trailing ones unsplit)."""
    return tuple(spec) + (None,) * (ndim - len(spec))


def state_shardings(state_shape, param_shardings: dict, tx, mesh, update_shardings=None):
    """Shardings of the TrainState: optimizer moments follow `update_shardings` (default: their
    parameters'), scalars replicated."""
    replicated = NamedSharding(mesh, P())
    moments = param_shardings if update_shardings is None else update_shardings
    opt = optim.opt_state_shardings(tx, state_shape.opt_state, moments, replicated)
    return TrainState(
        step=replicated, params=param_shardings, opt_state=opt, rng=replicated, healthy=replicated
    )


def error_line(err: Exception) -> str:
    """train.py's one line for an error that stops it; for running out of device memory, also what
    would fit. A runtime error of another kind is raised again, with its traceback."""
    if not isinstance(err, jax.errors.JaxRuntimeError):
        return f"error: {err}"
    if "RESOURCE_EXHAUSTED" not in str(err):
        raise err
    found = re.search(r"Out of memory.*?(?=\.?\s*\[|\.?\s*$)", str(err), re.MULTILINE)
    detail = found.group(0) if found else str(err).splitlines()[0]
    return (
        f"error: the train step does not fit the device memory ({detail}): lower "
        "data.batch_size, recompute each block in the backward (model.remat=block_keep_scan, "
        "or model.remat=block to keep the least), or spread it over more devices (mesh.data or "
        "mesh.seq with mesh.fsdp=true, mesh.tensor)"
    )
