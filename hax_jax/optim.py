"""AdamW with the paper schedules, gradient clipping and the weight-decay mask (SPEC §5)."""

import jax
import optax

from hax_jax.config import OptimConfig

# Weight decay only on matrices: every `kernel` (each part of one stored part by part,
# layers/fused.py: path .../kernel/<part>) and the embedding. That leaves out A_log, D, dt_bias,
# norm weights, biases, the HAX gate E and Infini's beta, as mamba_ssm's `_no_weight_decay` does.
DECAYED_NAMES = ("kernel", "embedding")


def learning_rate(cfg: OptimConfig, num_steps: int) -> optax.Schedule:
    """hold_steps at 0, then a linear warmup to peak_lr, then constant or cosine down to end_lr."""
    warm = optax.linear_schedule(0.0, cfg.peak_lr, max(cfg.warmup_steps, 1))
    if cfg.schedule == "warmup_constant":
        after = optax.constant_schedule(cfg.peak_lr)
    else:
        decay_steps = max(num_steps - cfg.hold_steps - cfg.warmup_steps, 1)
        after = optax.cosine_decay_schedule(
            cfg.peak_lr, decay_steps, alpha=cfg.end_lr / cfg.peak_lr
        )
    schedule = optax.join_schedules([warm, after], [cfg.warmup_steps])
    if cfg.hold_steps == 0:
        return schedule
    return optax.join_schedules([optax.constant_schedule(0.0), schedule], [cfg.hold_steps])


def _keys(path) -> tuple[str, ...]:
    """A parameter's tree path as its keys' names."""
    return tuple(str(getattr(p, "key", "")) for p in path)


def matches(path, name: str) -> bool:
    """Whether a parameter's tree path ends in `name`: a leaf name (A_log) or the path's last
    names joined by dots (dt_proj.bias: Mamba's dt bias, where a bare "bias" names every bias)."""
    parts = tuple(name.split("."))
    return _keys(path)[-len(parts) :] == parts


def named(params, names) -> dict:
    """True for the parameters one of `names` matches (see `matches`)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: any(matches(path, n) for n in names), params
    )


def decay_mask(params) -> dict:
    """True for the parameters weight decay applies to: a name of DECAYED_NAMES anywhere on the
    path, so that a kernel's parts are decayed as the kernel is (matched by leaf name alone, from
    793f502 to 2026-11-28 in_proj and Mamba-2's conv1d were not decayed)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: any(k in DECAYED_NAMES for k in _keys(path)), params
    )


def frozen_mask(names: tuple[str, ...]):
    """The mask of the parameters `names` match (see `matches`); a name that matches none is an
    error, raised when the optimizer is initialised (before any step)."""

    def mask(params) -> dict:
        paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
        missing = [n for n in names if not any(matches(path, n) for path in paths)]
        if missing:
            raise ValueError(f"optim.frozen names {missing}, which no parameter is called")
        return named(params, names)

    return mask


def make_optimizer(cfg: OptimConfig, num_steps: int) -> optax.GradientTransformation:
    """Clip by global norm (when clip_norm > 0), then AdamW on the schedule with the decay mask,
    then no update at all for the parameters cfg.frozen names."""
    adamw = optax.adamw(
        learning_rate(cfg, num_steps),
        b1=cfg.b1,
        b2=cfg.b2,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        mask=decay_mask,
    )
    chain = [adamw]
    if cfg.clip_norm > 0:
        chain.insert(0, optax.clip_by_global_norm(cfg.clip_norm))
    if cfg.frozen:  # only then: the optimizer state (and checkpoints) of other runs is unchanged
        chain.append(optax.masked(optax.set_to_zero(), frozen_mask(cfg.frozen)))
    return chain[0] if len(chain) == 1 else optax.chain(*chain)


def opt_state_shardings(tx: optax.GradientTransformation, opt_state_shape, param_shardings, other):
    """Shardings of the optimizer state: moments shaped like a parameter follow it, the rest
    `other`."""
    return optax.tree_map_params(
        tx,
        lambda _, sharding: sharding,
        opt_state_shape,
        param_shardings,
        transform_non_params=lambda _: other,
    )
