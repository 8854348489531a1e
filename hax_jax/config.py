"""Typed, frozen configs of a run, `key=value` overrides, JSON round trips and config files.

The model's configs live in model_config.py and are re-exported here: `from hax_jax.config import X`
reaches every config. Every field has a default and a comment; cross-field invariants live in
`__post_init__`.
"""

import dataclasses
import importlib.util
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal

from hax_jax.model_config import (
    DEFAULT_CAPACITY,
    LOGITS_BUDGET,
    MIXER_KINDS,
    REMAT_MIN_LEN,
    SCAN_STATES_SHARE,
    AttentionConfig,
    InfiniConfig,
    Mamba2Config,
    MambaConfig,
    MlpConfig,
    ModelConfig,
    SparseConfig,
)

__all__ = [
    "AttentionConfig",
    "Config",
    "DEFAULT_CAPACITY",
    "DataConfig",
    "InfiniConfig",
    "JointRecallConfig",
    "LOGITS_BUDGET",
    "MIXER_KINDS",
    "MOVED_KEYS",
    "Mamba2Config",
    "MambaConfig",
    "MeshConfig",
    "MlpConfig",
    "ModelConfig",
    "MqarConfig",
    "OptimConfig",
    "REMAT_MIN_LEN",
    "SCAN_STATES_SHARE",
    "SparseConfig",
    "TrainConfig",
    "apply_overrides",
    "from_dict",
    "load_config_file",
    "load_config_module",
    "load_json",
    "migrate_dict",
    "parse_value",
    "save_json",
    "to_dict",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class JointRecallConfig:
    """Multi-query joint recall (HAX paper §3.2; the HAX code's generator; SPEC §4)."""

    n_context: tuple[int, int] = (5, 16)  # contexts per example: uniform in [lo, hi]
    n_key: tuple[int, int] = (5, 16)  # keys per context: uniform in [lo, hi]
    n_value: int = 16  # |V|: values are tokens 10 .. 10 + n_value - 1
    max_n_context: int = 16  # sets the token ranges and the padded length ...
    max_n_key: int = 16  # ... (2 max_n_context)(2 max_n_key + 1) + 2 = 1058 by default
    outer_levels: tuple[int, ...] = ()  # multi-level contexts (App. C): sizes of extra outer levels
    train_size: int = 1_440_000  # the HAX code: 10000 per (n_context, n_key) pair, 144 pairs
    valid_size: int = 14_400  # and 100 per pair for valid and test

    def __post_init__(self):
        # An empty split fails only once training reaches it (an IndexError at the first evaluation,
        # a StopIteration at the first batch): refuse it here.
        for name in ("train_size", "valid_size"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"data.joint_recall.{name} must be positive, got {getattr(self, name)}"
                )


@dataclasses.dataclass(frozen=True, kw_only=True)
class MqarConfig:
    """Multi-query associative recall, Zoology's harder variant (Mamba-2 paper §9.1)."""

    num_kv_pairs: int = 64  # key-value pairs per sequence (the paper: seq_len / 4)
    curriculum: tuple[int, ...] = ()  # kv-pair counts of successive stages, e.g. (8, 16, 32, 64)
    stage_examples: int = 2**18  # examples per curriculum stage (the paper: 2^18) ...
    stage_epochs: int = 8  # ... each seen this many times before the next stage
    random_fill: bool = True  # fill non-kv/query positions with random tokens (the harder variant)
    valid_size: int = 3_000  # validation examples (at num_kv_pairs)

    def __post_init__(self):
        # An empty valid split fails only at the first evaluation (as joint recall's); the data
        # sources check the others, but only once a run starts and without the config key.
        for name in ("num_kv_pairs", "stage_examples", "stage_epochs", "valid_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"data.mqar.{name} must be positive, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """What the model trains and validates on (SPEC §4)."""

    task: Literal["joint_recall", "mqar", "tokens", "text"] = "joint_recall"
    batch_size: int = 64  # global batch (sequences per step, over all devices and processes)
    seq_len: int = 1024  # mqar / tokens / text sequence length (joint recall: its padded length)
    path: str = ""  # tokens: a .bin/.npy token file; text: a UTF-8 text file
    valid_path: str = ""  # held-out file; "" = the last valid_fraction of `path`
    valid_fraction: float = 0.01  # tokens / text without valid_path
    token_dtype: Literal["uint16", "uint32"] = "uint16"  # raw .bin token files
    eos_id: int = 0  # document separator in token files; seq_idx advances after it
    document_boundaries: bool = (
        True  # tokens / text: pass seq_idx (Mamba-1 and the branch take none)
    )
    tokenizer: str = (
        ""  # text: a tokenizer directory (tokenizer.json); "" = train a BPE into workdir
    )
    seed: int = 0  # data order and generation
    eval_batches: int = 0  # validation batches per evaluation (every task); 0 = the whole split
    joint_recall: JointRecallConfig = JointRecallConfig()
    mqar: MqarConfig = MqarConfig()

    def __post_init__(self):
        if self.batch_size < 1:
            raise ValueError(f"data.batch_size must be positive, got {self.batch_size}")
        if self.seq_len < 2:
            raise ValueError(f"data.seq_len must be at least 2, got {self.seq_len}")
        if not 0.0 < self.valid_fraction < 1.0:
            raise ValueError(f"data.valid_fraction must be in (0, 1), got {self.valid_fraction}")
        if self.eval_batches < 0:
            raise ValueError(f"data.eval_batches must be >= 0 (0 = all), got {self.eval_batches}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """The device mesh ("data", "seq", "tensor"); at most one size may be -1 (= the devices
    left)."""

    data: int = -1  # batch sharding
    seq: int = 1  # sequence sharding of activations
    tensor: int = 1  # d_inner / heads / vocab sharding
    fsdp: bool = False  # also shard parameters' d_model over "data" and "seq" (a rule change)
    # Split the AdamW moments and the update over "data" and "seq" (d_model, as FSDP splits
    # parameters), keeping the parameters whole (ZeRO-1): each device updates its slice of the
    # gradients, the new parameters are gathered. fsdp implies it.
    shard_optimizer: bool = False
    # With shard_optimizer, where the updated parameters are gathered whole. "update": at the end of
    # the step that updated them, so they rest whole; that gather ends the step with nothing left
    # to run beside it (the global-norm clip waits for every gradient before any update). "use": at
    # the start of the step that uses them, where XLA may run it beside the forward; they rest
    # split like the moments, and the gathered copy is a temporary of the step (4 bytes a
    # parameter; 2 for those the model reads only cast to a bf16 / fp16 model.dtype, the matmuls'
    # kernels, which are gathered cast: hax_jax/gather.py). The trained numbers are the same
    # either way.
    param_gather: Literal["update", "use"] = "update"
    # XLA:GPU's joining of the gradients' and parameters' collectives over "data" and "seq"
    # (all-reduces; with fsdp or shard_optimizer also reduce-scatters and all-gathers) into fewer,
    # larger ones. Joined without limit across many blocks, XLA holds every block's weight-gradient
    # inputs to the end of the backward (HAX-Mamba-2 130M 1M tokens on seq=2 then failed to
    # allocate 342.89 GiB; Mamba-2 32K with fsdp on seq=2, when only all-reduces were limited,
    # held 7.35 GiB of temporaries a GPU against 2.98 without fsdp, its blocks' weight-gradient
    # matmuls moved to the end of the backward); never joined, a split sequence pays for hundreds
    # of small all-reduces. "block": joined up to the largest block's parameter bytes on
    # a device before fsdp's split (2 x H200, seq=2: Mamba-2 32K 89.70 ms against 92.59 unjoined and
    # 88.74 unlimited; HAX 1M tokens fit, 89.9 GiB a GPU; HAX 64K holds 9.10 GiB of temporaries a
    # GPU, 6.81 unjoined; BENCHMARKS.md, "Multi-GPU training step"). "auto": "block" where GPUs
    # split the sequence, XLA's default otherwise. "on": XLA's default everywhere; "off": never
    # joined (the least memory). "off" and "block" are XLA:GPU settings, refused elsewhere.
    combine_collectives: Literal["auto", "on", "off", "block"] = "auto"


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW with the paper schedules (SPEC §5)."""

    schedule: Literal["warmup_constant", "warmup_cosine"] = "warmup_constant"
    peak_lr: float = 2e-3  # joint recall: 2e-3
    hold_steps: int = 0  # steps at lr 0 before the warmup (continual pre-training: 200)
    warmup_steps: int = 5000  # linear warmup from 0 to peak_lr
    end_lr: float = 1e-5  # warmup_cosine: the value at train.num_steps
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = (
        0.01  # torch AdamW's default (the HAX trainer); never on A_log/D/dt_bias/norms/biases/E
    )
    clip_norm: float = 1.0  # global gradient-norm clip; 0 = off
    # Parameters never updated, by leaf name or dotted path suffix ((A_log,dt_bias) for Mamba-2,
    # (A_log,dt_proj.bias) for Mamba): where the HAX code's AdamW on bf16 parameters leaves them
    # (a step below half a bf16 spacing rounds back).
    frozen: tuple[str, ...] = ()

    def __post_init__(self):
        # A negative rate or decay trains (the wrong way) without a sign; refuse it up front.
        checks = [
            ("peak_lr", self.peak_lr > 0, "> 0"),
            ("hold_steps", self.hold_steps >= 0, ">= 0"),
            ("warmup_steps", self.warmup_steps >= 0, ">= 0"),
            ("b1", 0 <= self.b1 < 1, "in [0, 1)"),
            ("b2", 0 <= self.b2 < 1, "in [0, 1)"),
            ("eps", self.eps > 0, "> 0"),
            ("weight_decay", self.weight_decay >= 0, ">= 0"),
            ("clip_norm", self.clip_norm >= 0, ">= 0 (0 = off)"),
        ]
        if self.schedule == "warmup_cosine":
            checks.append(("end_lr", 0 <= self.end_lr <= self.peak_lr, "in [0, optim.peak_lr]"))
        for name, ok, bound in checks:
            if not ok:
                raise ValueError(f"optim.{name} must be {bound}, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The loop: length, cadence, checkpoints."""

    num_steps: int = 1000  # optimizer steps
    log_every: int = 50  # training metrics to metrics.jsonl / TensorBoard
    eval_every: int = 500  # validation (always also at the last step)
    checkpoint_every: int = 500  # orbax checkpoint (always also at the last step)
    keep_checkpoints: int = 3  # latest checkpoints kept (plus the best by validation)
    init_from: str = (
        ""  # a converted / pretrained checkpoint directory to start the parameters from
    )
    progress: bool = True  # a progress bar on stderr

    def __post_init__(self):
        for name in (
            "num_steps",
            "log_every",
            "eval_every",
            "checkpoint_every",
            "keep_checkpoints",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be positive, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Everything a run needs; `configs/<name>.py` returns one from `get_config()`."""

    model: ModelConfig = ModelConfig()  # the network
    data: DataConfig = DataConfig()  # the task and its batches
    optim: OptimConfig = OptimConfig()  # AdamW and its schedule
    train: TrainConfig = TrainConfig()  # the loop
    mesh: MeshConfig = MeshConfig()  # the device layout
    seed: int = 0  # parameter init and training rng seed
    workdir: str = ""  # where checkpoints and metrics go


# ----------------------------------------------------------------------------- overrides


# Keys that moved (old: (new, why)): an override of the old one is refused with the new one; a
# saved config (a workdir's config.json, a checkpoint's) is read with the value moved.
MOVED_KEYS = {
    "data.joint_recall.eval_batches": ("data.eval_batches", "it applies to every task"),
    "mesh.combine_all_reduces": (
        "mesh.combine_collectives",
        "it limits the joining of reduce-scatters and all-gathers too",
    ),
}


def apply_overrides(cfg: Any, overrides: typing.Sequence[str]) -> Any:
    """Returns `cfg` with dotted `key=value` overrides applied, each parsed to its field's type."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} is not of the form key=value")
        if key in MOVED_KEYS:
            raise ValueError(f"{key} is now {MOVED_KEYS[key][0]} ({MOVED_KEYS[key][1]})")
        cfg = _replace_path(cfg, key.split("."), raw, key)
    return cfg


def _replace_path(obj: Any, path: list[str], raw: str, key: str) -> Any:
    """Replaces the field at `path` in the dataclass `obj` by `raw` parsed to its type."""
    names = [f.name for f in dataclasses.fields(obj)]
    if path[0] not in names:
        raise ValueError(
            f"unknown config key {key!r}: {type(obj).__name__} has no field {path[0]!r} "
            f"(fields: {', '.join(names)})"
        )
    hint = typing.get_type_hints(type(obj))[path[0]]
    if len(path) == 1:
        if dataclasses.is_dataclass(hint):
            raise ValueError(
                f"config key {key!r} is a section; set one of its fields, e.g. {key}.<field>=..."
            )
        value = parse_value(raw, hint, key)
    else:
        child = getattr(obj, path[0])
        if not dataclasses.is_dataclass(child):
            raise ValueError(
                f"unknown config key {key!r}: {path[0]!r} is a {hint} field, not a section"
            )
        value = _replace_path(child, path[1:], raw, key)
    return dataclasses.replace(obj, **{path[0]: value})


def parse_value(raw: str, hint: Any, key: str) -> Any:
    """Parses the command-line string `raw` as type `hint`; errors name `key` and `raw`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    bad = ValueError(f"config key {key!r} expects {_type_name(hint)}, got {raw!r}")
    text = raw.strip()
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and text.lower() in ("none", "null"):
            return None
        for arg in args:
            if arg is not type(None):
                try:
                    return parse_value(raw, arg, key)
                except ValueError:
                    pass
        raise bad
    if origin is Literal:
        if text not in args:
            raise ValueError(f"config key {key!r} must be one of {args}, got {raw!r}")
        return text
    if origin is tuple:
        items = [s.strip().strip("'\"") for s in text.strip("()[]").split(",") if s.strip()]
        types_ = [args[0]] * len(items) if len(args) == 2 and args[1] is Ellipsis else list(args)
        if len(types_) != len(items):
            raise bad
        return tuple(parse_value(s, t, key) for s, t in zip(items, types_, strict=True))
    if hint is bool:
        if text.lower() in ("true", "1", "yes"):
            return True
        if text.lower() in ("false", "0", "no"):
            return False
        raise bad
    if hint in (int, float, str):
        try:
            return hint(text)
        except ValueError:
            raise bad from None
    raise ValueError(
        f"config key {key!r} has a type ({_type_name(hint)}) that cannot be set from the CLI"
    )


def _type_name(hint: Any) -> str:
    """A readable name of a type hint."""
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


# ----------------------------------------------------------------------------- files


def to_dict(cfg: Any) -> dict:
    """The config as a JSON-ready nested dict."""
    return dataclasses.asdict(cfg)


def from_dict(cls: type, data: dict, *, where: str = "") -> Any:
    """Builds dataclass `cls` from a nested dict (as written by `to_dict`); unknown keys are
    errors."""
    hints = typing.get_type_hints(cls)
    unknown = set(data) - set(hints)
    if unknown:
        raise ValueError(
            f"unknown config keys {sorted(where + k for k in unknown)} for {cls.__name__}"
        )
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            value = from_dict(hint, value, where=f"{where}{name}.")
        elif isinstance(value, list):
            value = tuple(value)
        kwargs[name] = value
    return cls(**kwargs)


def save_json(cfg: Any, path: str | Path) -> None:
    """Writes the resolved config as JSON."""
    Path(path).write_text(json.dumps(to_dict(cfg), indent=2) + "\n")


def migrate_dict(data: dict) -> dict:
    """A saved config dict with every MOVED_KEYS value at its new place (a copy)."""
    data = json.loads(json.dumps(data))
    for old, (new, _) in MOVED_KEYS.items():
        *old_parents, old_leaf = old.split(".")
        parent = data
        for name in old_parents:
            parent = parent.get(name, {}) if isinstance(parent, dict) else {}
        if isinstance(parent, dict) and old_leaf in parent:
            value = parent.pop(old_leaf)
            *new_parents, new_leaf = new.split(".")
            target = data
            for name in new_parents:
                target = target.setdefault(name, {})
            target.setdefault(new_leaf, value)
    return data


def load_json(cls: type, path: str | Path) -> Any:
    """Reads a config written by `save_json`; a damaged file is an error naming it, not a
    traceback."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{str(path)!r} is not valid JSON: {err}") from None
    return from_dict(cls, migrate_dict(data) if cls is Config else data)


def load_config_file(spec: str | Path) -> Config:
    """Runs `configs/<name>.py` and returns its `get_config()`; `configs/<name>.py:<arg>` passes
    `arg`."""
    path_text, _, arg = str(spec).partition(".py:")
    module = load_config_module(path_text + ".py" if arg else spec)
    return module.get_config(arg) if arg else module.get_config()


def load_config_module(path: str | Path) -> types.ModuleType:
    """The module of a config file (its get_config(), and a grid's VARIANTS); errors name the
    file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist")
    module_spec = importlib.util.spec_from_file_location(f"_hax_config_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ValueError(f"config file {str(path)!r} defines no get_config()")
    return module
