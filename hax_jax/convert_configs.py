"""HF / mamba_ssm config.json <-> our ModelConfig, for hax_jax/convert.py.

Every key that changes the function is read or refused by name; keys that only shape the init or
PyTorch's runtime are ignored.
"""

import json
import math
from pathlib import Path

from hax_jax.config import Mamba2Config, MambaConfig, ModelConfig

# mamba_ssm ssm_cfg keys that only shape the init (or the PyTorch runtime), never the function.
_INIT_ONLY_KEYS = {
    "dt_init",
    "dt_min",
    "dt_max",
    "dt_init_floor",
    "dt_scale",
    "A_init_range",
    "use_fast_path",
    "layer_idx",
    "device",
    "dtype",
    "process_group",
    "sequence_parallel",
    "conv_init",
    "layer",
    "learnable_init_states",
}


class ConversionError(ValueError):
    """The source is not a checkpoint this converter understands; the message says why."""


# ----------------------------------------------------------------------------- configs


def read_config(src: Path) -> ModelConfig:
    """Our ModelConfig from an HF or mamba_ssm config.json."""
    path = src / "config.json"
    if not path.is_file():
        raise ConversionError(f"{str(src)!r} is not a Mamba checkpoint: it has no config.json")
    raw = read_json(path)
    if "model_type" in raw:
        if raw["model_type"] == "mamba":
            return _from_hf_mamba(raw)
        if raw["model_type"] == "mamba2":
            return _from_hf_mamba2(raw)
        raise ConversionError(
            f"unknown model_type {raw['model_type']!r} in {str(path)!r}; "
            "expected 'mamba' or 'mamba2'"
        )
    if "d_model" in raw and "n_layer" in raw:
        return _from_mamba_ssm(raw)
    raise ConversionError(
        f"{str(path)!r} is not a Mamba config: no model_type, and no d_model/n_layer"
    )


def read_json(path: Path):
    """A JSON file's content; a ConversionError naming the file if it is not JSON."""
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConversionError(f"{str(path)!r} is not valid JSON: {err}") from None


def _float(value) -> float:
    """A float from config JSON; transformers 5 writes infinity as {"__float__": "Infinity"}."""
    return float(value["__float__"] if isinstance(value, dict) else value)


def _require(raw: dict, key: str, allowed, where: str):
    """Errors unless raw[key] (when present) is one of `allowed`."""
    if key in raw and raw[key] not in allowed:
        raise ConversionError(
            f"{where}: {key}={raw[key]!r} is not supported (supported: {allowed})"
        )


def _from_hf_mamba(raw: dict) -> ModelConfig:
    """HF MambaConfig -> ModelConfig."""
    _require(raw, "hidden_act", ("silu", "swish"), "HF mamba config")
    d = raw["hidden_size"]
    rank = raw.get("time_step_rank", "auto")
    return ModelConfig(
        d_model=d,
        n_layer=raw["num_hidden_layers"],
        vocab_size=raw["vocab_size"],
        pad_vocab_size_multiple=1,  # HF stores the padded vocab
        block_pattern=("mamba",),
        tie_embeddings=raw.get("tie_word_embeddings", True),
        residual_in_fp32=raw.get("residual_in_fp32", True),
        norm_eps=raw.get("layer_norm_epsilon", 1e-5),
        mamba=MambaConfig(
            d_state=raw.get("state_size", 16),
            d_conv=raw.get("conv_kernel", 4),
            expand=raw.get("expand", 2),
            dt_rank=math.ceil(d / 16) if rank == "auto" else int(rank),
            dt_min=raw.get("time_step_min", 1e-3),
            dt_max=raw.get("time_step_max", 0.1),
            dt_init_floor=raw.get("time_step_floor", 1e-4),
            dt_scale=raw.get("time_step_scale", 1.0),
            conv_bias=raw.get("use_conv_bias", True),
            bias=raw.get("use_bias", False),
        ),
    )


def _from_hf_mamba2(raw: dict) -> ModelConfig:
    """HF Mamba2Config -> ModelConfig."""
    _require(raw, "hidden_act", ("silu", "swish"), "HF mamba2 config")
    d, expand = raw["hidden_size"], raw.get("expand", 2)
    heads, headdim = raw.get("num_heads", 128), raw.get("head_dim", 64)
    if d * expand != heads * headdim:
        raise ConversionError(
            f"HF mamba2 config: hidden_size*expand={d * expand} != "
            f"num_heads*head_dim={heads * headdim}"
        )
    return ModelConfig(
        d_model=d,
        n_layer=raw["num_hidden_layers"],
        vocab_size=raw["vocab_size"],
        pad_vocab_size_multiple=1,
        block_pattern=("mamba2",),
        tie_embeddings=raw.get("tie_word_embeddings", False),
        residual_in_fp32=raw.get("residual_in_fp32", True),
        norm_eps=raw.get("layer_norm_epsilon", 1e-5),
        mamba2=Mamba2Config(
            d_state=raw.get("state_size", 128),
            d_conv=raw.get("conv_kernel", 4),
            expand=expand,
            headdim=headdim,
            ngroups=raw.get("n_groups", 8),
            chunk_size=raw.get("chunk_size", 256),
            dt_min=raw.get("time_step_min", 1e-3),
            dt_max=raw.get("time_step_max", 0.1),
            dt_init_floor=raw.get("time_step_floor", 1e-4),
            dt_limit=tuple(_float(v) for v in raw.get("time_step_limit", (0.0, math.inf))),
            conv_bias=raw.get("use_conv_bias", True),
            bias=raw.get("use_bias", False),
        ),
    )


def _from_mamba_ssm(raw: dict) -> ModelConfig:
    """mamba_ssm MambaConfig (d_model, n_layer, ssm_cfg, ...) -> ModelConfig."""
    where = "mamba_ssm config"
    if raw.get("attn_layer_idx"):
        raise ConversionError(
            f"{where}: attention layers (attn_layer_idx={raw['attn_layer_idx']}) are not supported"
        )
    if raw.get("d_intermediate", 0):
        raise ConversionError(
            f"{where}: MLP layers (d_intermediate={raw['d_intermediate']}) are not supported"
        )
    _require(raw, "rms_norm", (True,), where)
    ssm = dict(raw.get("ssm_cfg") or {})
    layer = ssm.get("layer", "Mamba1")
    if layer not in ("Mamba1", "Mamba2"):
        raise ConversionError(
            f"{where}: unknown ssm_cfg.layer {layer!r}; expected 'Mamba1' or 'Mamba2'"
        )
    _require(ssm, "activation", ("silu", "swish"), where)
    for key in ("rmsnorm",):
        _require(ssm, key, (True,), where)
    for key in ("norm_before_gate", "D_has_hdim"):
        _require(ssm, key, (False,), where)
    init_kw = {k: ssm[k] for k in ("dt_min", "dt_max", "dt_init_floor") if k in ssm}
    base = dict(
        d_model=raw["d_model"],
        n_layer=raw["n_layer"],
        vocab_size=raw["vocab_size"],
        pad_vocab_size_multiple=raw.get("pad_vocab_size_multiple", 8),
        tie_embeddings=raw.get("tie_embeddings", True),
        residual_in_fp32=raw.get("residual_in_fp32", True),
    )
    structural = {
        "d_state",
        "d_conv",
        "expand",
        "conv_bias",
        "bias",
        "activation",
        "rmsnorm",
        "norm_before_gate",
        "D_has_hdim",
    }
    if layer == "Mamba1":
        known = structural | {"dt_rank"}
        _check_known(ssm, known, where)
        rank = ssm.get("dt_rank", "auto")
        mixer = MambaConfig(
            d_state=ssm.get("d_state", 16),
            d_conv=ssm.get("d_conv", 4),
            expand=ssm.get("expand", 2),
            dt_rank=None if rank == "auto" else int(rank),
            dt_scale=ssm.get("dt_scale", 1.0),
            conv_bias=ssm.get("conv_bias", True),
            bias=ssm.get("bias", False),
            **init_kw,
        )
        return ModelConfig(block_pattern=("mamba",), mamba=mixer, **base)
    _check_known(ssm, structural | {"headdim", "ngroups", "chunk_size", "dt_limit"}, where)
    mixer = Mamba2Config(
        d_state=ssm.get("d_state", 128),
        d_conv=ssm.get("d_conv", 4),
        expand=ssm.get("expand", 2),
        headdim=ssm.get("headdim", 64),
        ngroups=ssm.get("ngroups", 1),
        chunk_size=ssm.get("chunk_size", 256),
        dt_limit=tuple(_float(v) for v in ssm.get("dt_limit", (0.0, math.inf))),
        A_init_range=tuple(ssm.get("A_init_range", (1.0, 16.0))),
        conv_bias=ssm.get("conv_bias", True),
        bias=ssm.get("bias", False),
        **init_kw,
    )
    return ModelConfig(block_pattern=("mamba2",), mamba2=mixer, **base)


def _check_known(ssm: dict, known: set, where: str) -> None:
    """Errors on ssm_cfg keys we do not understand (rather than silently converting another
    model)."""
    unknown = set(ssm) - known - _INIT_ONLY_KEYS
    if unknown:
        raise ConversionError(f"{where}: unsupported ssm_cfg keys {sorted(unknown)}")


def hf_config(cfg: ModelConfig) -> dict:
    """The HF config.json of a pure Mamba or Mamba-2 ModelConfig."""
    kinds = set(cfg.block_pattern)
    if kinds not in ({"mamba"}, {"mamba2"}):
        raise ConversionError(
            f"block_pattern {cfg.block_pattern} has no HF equivalent; "
            "only pure ('mamba',) or ('mamba2',) models convert to HF"
        )
    m = cfg.mamba if kinds == {"mamba"} else cfg.mamba2
    # Fields both HF configs share, read from the mixer config (both use mamba_ssm's names).
    common = dict(
        hidden_size=cfg.d_model,
        num_hidden_layers=cfg.n_layer,
        vocab_size=cfg.padded_vocab_size,
        tie_word_embeddings=cfg.tie_embeddings,
        residual_in_fp32=cfg.residual_in_fp32,
        layer_norm_epsilon=cfg.norm_eps,
        hidden_act="silu",
        state_size=m.d_state,
        conv_kernel=m.d_conv,
        expand=m.expand,
        time_step_min=m.dt_min,
        time_step_max=m.dt_max,
        time_step_floor=m.dt_init_floor,
        use_conv_bias=m.conv_bias,
        use_bias=m.bias,
    )
    if kinds == {"mamba"}:
        return dict(
            model_type="mamba",
            architectures=["MambaForCausalLM"],
            time_step_rank=m.dt_rank or math.ceil(cfg.d_model / 16),
            time_step_scale=m.dt_scale,
            **common,
        )
    return dict(
        model_type="mamba2",
        architectures=["Mamba2ForCausalLM"],
        head_dim=m.headdim,
        num_heads=m.expand * cfg.d_model // m.headdim,
        n_groups=m.ngroups,
        chunk_size=m.chunk_size,
        time_step_limit=list(m.dt_limit),
        **common,
    )
