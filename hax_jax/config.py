"""Typed, frozen configs, `key=value` overrides, and JSON round trips.

Every field has a default and a comment; cross-field invariants live in `__post_init__`. Field names
follow mamba_ssm (`d_model n_layer d_state d_conv expand headdim ngroups chunk_size vocab_size`).
"""

import dataclasses
import importlib.util
import json
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal

from pallas_kernels.sparse_attention import SparseSpec

MIXER_KINDS = ("mamba", "mamba2", "attention", "swa", "mlp", "infini")
# Tokens a decode cache holds unless init_cache is asked for more (full attention's KV buffer and the
# sparse branch's key/value buffers grow with it; SSM states, windows and memories do not).
DEFAULT_CAPACITY = 4096
# remat="auto" recomputes every block in the backward for rows of at least this many tokens. The
# 130M step at 1 x 32768 tokens held 35 GiB on one GPU (ENV.md; ~1.1 MB a token, mostly saved
# activations), so from 8192 tokens a row a batch of 8 rows outgrows an 80 GB GPU, while the
# 8 x 2048 steps fit and are spared the extra forward. H200, Mamba-2 130M, 1 x 32768, whole-row
# loss: 118.8 ms / 35.0 GiB without remat, 145.4 ms / 13.1 GiB with.
REMAT_MIN_LEN = 8192
# loss_chunk=0 (auto): the most fp32 logits (b, l, padded vocab) one device computes at once. The
# 130M step at 8 x 2048 (3.3 GB at a 50288 vocab) stays whole; 1 x 1M tokens (211 GB) goes in 64
# chunks. H200, 1 x 32768 with remat: 2 chunks 152.1 ms / 8.7 GiB, whole rows 145.4 ms / 13.1 GiB.
LOGITS_BUDGET = 4 * 2**30


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparseConfig:
    """The sparse-attention branch beside every mamba / mamba2 mixer (HAX paper §4; SPEC §1.3)."""

    pattern: str = ""  # "" = no branch; else '+'-joined components ("lsh+ks" = HAX; see SparseSpec)
    num_keys: int = 64  # keys per query over all components; each gets num_keys // n_components
    hash_bits: int = 8  # lsh: h random projections (2^h sign-bit buckets, or h argmax buckets)
    binning: Literal["sign", "argmax"] = "sign"  # lsh bucket rule (paper eqs. 6-7)
    max_len: int = 1058  # dilated: dilation = max_len // (keys per component)
    rank_loss_weight: float = 0.1  # alpha in L = L_task + alpha * sum_layers L_rank
    eval_hash_seed: int = 0  # the fixed hash projection used in evaluation
    official_code: bool = (
        False  # the official code's (leaky, dense) behaviours instead of the paper's
    )
    impl: Literal["auto", "indexed", "pallas"] = "auto"  # op impl; auto: Pallas on GPU

    def __post_init__(self):
        """A set pattern must describe a valid attention: building its spec checks every setting."""
        if self.pattern:
            _ = self.spec

    @property
    def spec(self) -> SparseSpec:
        """The attention these settings describe; a ValueError naming model.sparse if invalid."""
        try:
            return SparseSpec(
                self.pattern,
                self.num_keys,
                hash_bits=self.hash_bits,
                binning=self.binning,
                max_len=self.max_len,
                official_code=self.official_code,
            )
        except ValueError as err:
            raise ValueError(f"model.sparse: {err}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionConfig:
    """Multi-head causal attention with RoPE ("attention"), and its sliding-window form ("swa")."""

    n_heads: int = 4  # query/key/value heads
    head_dim: int | None = None  # None = d_model // n_heads
    rope_theta: float = 10000.0  # RoPE base
    window: int = 64  # swa: each query sees itself and the window - 1 keys before it
    qkv_bias: bool = False  # bias in the q/k/v projections


@dataclasses.dataclass(frozen=True, kw_only=True)
class MlpConfig:
    """The SwiGLU MLP block ("mlp")."""

    hidden_ratio: float = (
        4.0  # d_ff = 2/3 * hidden_ratio * d_model, rounded up to a multiple of 256 ...
    )
    d_ff: int | None = None  # ... unless given here


@dataclasses.dataclass(frozen=True, kw_only=True)
class InfiniConfig:
    """Infini-attention ("infini"): local causal attention per segment plus a compressive memory."""

    n_heads: int = 4  # heads, each with its own memory and gate
    head_dim: int | None = None  # None = d_model // n_heads
    segment_len: int = 64  # N: tokens per segment
    update: Literal["linear", "delta"] = "linear"  # memory update rule (Infini paper eqs. 8-9)
    rope_theta: float = 10000.0  # RoPE for the local attention only


@dataclasses.dataclass(frozen=True, kw_only=True)
class MambaConfig:
    """The Mamba-1 (S6) mixer (mamba_ssm `Mamba`)."""

    d_state: int = 16  # SSM state size N
    d_conv: int = 4  # depthwise causal conv width
    expand: int = 2  # d_inner = expand * d_model
    dt_rank: int | None = None  # rank R of the dt projection; None = ceil(d_model / 16)
    dt_min: float = 1e-3  # dt init: log-uniform in [dt_min, dt_max] ...
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4  # ... clamped below at this floor
    dt_scale: float = 1.0  # dt_proj weight init bound = dt_scale / sqrt(R)
    conv_bias: bool = True  # bias in the conv
    bias: bool = False  # bias in in_proj and out_proj
    scan_impl: Literal["auto", "reference", "associative", "pallas"] = "auto"  # auto: Pallas on GPU


@dataclasses.dataclass(frozen=True, kw_only=True)
class Mamba2Config:
    """The Mamba-2 (SSD) mixer (mamba_ssm `Mamba2`)."""

    d_state: int = 128  # SSM state size N
    d_conv: int = 4  # depthwise causal conv width (over x, B and C)
    expand: int = 2  # d_inner = expand * d_model
    headdim: int = 64  # P; n_heads = d_inner // headdim
    ngroups: int = 1  # G groups of B and C shared by n_heads // G heads each
    A_init_range: tuple[float, float] = (1.0, 16.0)  # -A init: uniform in this range
    dt_min: float = 1e-3  # dt init: log-uniform in [dt_min, dt_max] ...
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4  # ... clamped below at this floor
    dt_limit: tuple[float, float] = (0.0, math.inf)  # dt = clip(softplus(dt + dt_bias), *dt_limit)
    conv_bias: bool = True  # bias in the conv
    bias: bool = False  # bias in in_proj and out_proj
    chunk_size: int = 256  # SSD chunk length Q (any sequence length works; padded internally)
    ssd_impl: Literal["auto", "reference", "chunked", "pallas"] = "auto"  # auto: Pallas on GPU

    def __post_init__(self):
        if self.chunk_size < 1:
            raise ValueError(f"mamba2.chunk_size must be positive, got {self.chunk_size}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The language model: embeddings -> blocks -> final norm -> head."""

    d_model: int = 768  # residual width
    n_layer: int = 24  # number of residual blocks
    vocab_size: int = 50277  # real vocabulary; token ids must be below this
    pad_vocab_size_multiple: int = 8  # embedding rows = vocab_size rounded up to this multiple
    block_pattern: tuple[str, ...] = ("mamba",)  # mixer kinds, repeated cyclically over the layers
    tie_embeddings: bool = True  # the head reuses the embedding matrix
    residual_in_fp32: bool = True  # keep the residual stream in fp32 whatever the compute dtype
    norm_eps: float = 1e-5  # RMSNorm epsilon (block norms, final norm, Mamba-2 gated norm)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # compute dtype; params are fp32
    # The backward's memory: "block" keeps each residual block's input only and recomputes the
    # rest of the block; "none" keeps what autodiff saves; "auto" = "block" for rows of at least
    # REMAT_MIN_LEN tokens.
    remat: Literal["auto", "none", "block"] = "auto"
    # Positions per row whose logits the loss computes at once (more wait in a scan under
    # jax.checkpoint, so neither pass holds (b, l, vocab) logits); 0 = auto, under LOGITS_BUDGET.
    loss_chunk: int = 0
    mamba: MambaConfig = MambaConfig()  # settings of every "mamba" layer
    mamba2: Mamba2Config = Mamba2Config()  # settings of every "mamba2" layer
    sparse: SparseConfig = (
        SparseConfig()
    )  # the sparse-attention branch of every mamba / mamba2 layer
    attention: AttentionConfig = AttentionConfig()  # settings of every "attention" / "swa" layer
    mlp: MlpConfig = MlpConfig()  # settings of every "mlp" layer
    infini: InfiniConfig = InfiniConfig()  # settings of every "infini" layer

    def __post_init__(self):
        for name in ("d_model", "n_layer", "vocab_size", "pad_vocab_size_multiple"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.loss_chunk < 0:
            raise ValueError(f"model.loss_chunk must be >= 0 (0 = auto), got {self.loss_chunk}")
        if not self.block_pattern:
            raise ValueError("model.block_pattern must name at least one mixer kind")
        for kind in self.block_pattern:
            if kind not in MIXER_KINDS:
                raise ValueError(
                    f"unknown mixer kind {kind!r} in model.block_pattern; known: {MIXER_KINDS}"
                )
        if self.n_layer % len(self.block_pattern):
            raise ValueError(
                f"model.n_layer={self.n_layer} must be a multiple of "
                f"len(model.block_pattern)={len(self.block_pattern)}"
            )
        if "mamba2" in self.block_pattern:
            m2 = self.mamba2
            d_inner = m2.expand * self.d_model
            if d_inner % m2.headdim:
                raise ValueError(
                    f"d_inner={d_inner} must be a multiple of mamba2.headdim={m2.headdim}"
                )
            if (d_inner // m2.headdim) % m2.ngroups:
                raise ValueError(
                    f"n_heads={d_inner // m2.headdim} must be a multiple of mamba2.ngroups={m2.ngroups}"
                )

    @property
    def padded_vocab_size(self) -> int:
        """Embedding rows: vocab_size rounded up to pad_vocab_size_multiple."""
        m = self.pad_vocab_size_multiple
        return -(-self.vocab_size // m) * m

    @property
    def mixer_kinds(self) -> tuple[str, ...]:
        """The mixer kind of every layer."""
        return tuple(self.block_pattern[i % len(self.block_pattern)] for i in range(self.n_layer))


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
    """The device mesh ("data", "seq", "tensor"); at most one size may be -1 (= the devices left)."""

    data: int = -1  # batch sharding
    seq: int = 1  # sequence sharding of activations
    tensor: int = 1  # d_inner / heads / vocab sharding
    fsdp: bool = False  # also shard parameters' d_model axis over "data" (FSDP as a rule change)


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


# Keys that moved: an override of the old one is refused with the new one; a saved config (a
# workdir's config.json, a checkpoint's) is read with the value moved.
MOVED_KEYS = {"data.joint_recall.eval_batches": "data.eval_batches"}


def apply_overrides(cfg: Any, overrides: typing.Sequence[str]) -> Any:
    """Returns `cfg` with dotted `key=value` overrides applied, each parsed to its field's type."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} is not of the form key=value")
        if key in MOVED_KEYS:
            raise ValueError(f"{key} is now {MOVED_KEYS[key]} (it applies to every task)")
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
    """Builds dataclass `cls` from a nested dict (as written by `to_dict`); unknown keys are errors."""
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
    for old, new in MOVED_KEYS.items():
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
    """Reads a config written by `save_json`; a damaged file is an error naming it, not a traceback."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{str(path)!r} is not valid JSON: {err}") from None
    return from_dict(cls, migrate_dict(data) if cls is Config else data)


def load_config_file(spec: str | Path) -> Config:
    """Runs `configs/<name>.py` and returns its `get_config()`; `configs/<name>.py:<arg>` passes `arg`."""
    path_text, _, arg = str(spec).partition(".py:")
    module = load_config_module(path_text + ".py" if arg else spec)
    return module.get_config(arg) if arg else module.get_config()


def load_config_module(path: str | Path) -> types.ModuleType:
    """The module of a config file (its get_config(), and a grid's VARIANTS); errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist")
    module_spec = importlib.util.spec_from_file_location(f"_hax_config_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ValueError(f"config file {str(path)!r} defines no get_config()")
    return module
