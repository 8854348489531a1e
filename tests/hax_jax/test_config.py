"""Configs: overrides parse to the field's type or fail naming the key; every config builds; param
counts."""

import dataclasses
import json
import math
from pathlib import Path

import jax
import pytest
from flax import nnx

from hax_jax import config as config_lib
from hax_jax.checkpoint import abstract_model, check_resumable
from hax_jax.config import Config, ModelConfig
from hax_jax.data import split_cache
from hax_jax.data.pipeline import make_source, row_length

CONFIG_DIR = Path(__file__).parents[2] / "configs"
RELEASED = config_lib.load_config_module(CONFIG_DIR / "released.py").NAMES
# Every config file (with its default argument) and every released model: (id, spec).
CONFIGS = [(p.stem, str(p)) for p in sorted(CONFIG_DIR.glob("*.py"))] + [
    (name, f"{CONFIG_DIR / 'released.py'}:{name}") for name in RELEASED
]

# PAPERS.md §4.2 (tied embeddings; vocab padded to 50280 / 50288), in millions, as printed.
# Compared at the printed precision.
RELEASED_PARAMS_M = {
    "mamba_130m": "129.1",
    "mamba_370m": "371.5",
    "mamba_790m": "793.2",
    "mamba_1_4b": "1372",
    "mamba_2_8b": "2768",
    "mamba2_130m": "129.0",
    "mamba2_780m": "780.2",
    "mamba2_1_3b": "1343.8",
    "mamba2_2_7b": "2702.6",
}


def _param_count(cfg: ModelConfig) -> int:
    """Parameters of the model, from shapes only (nothing allocated)."""
    state = nnx.state(abstract_model(cfg), nnx.Param)
    return sum(math.prod(x.shape) for x in jax.tree.leaves(state))


def test_overrides_parse_to_field_types():
    cfg = config_lib.apply_overrides(
        Config(),
        [
            "seed=3",
            "workdir=/tmp/run",
            "model.d_model=128",
            "model.norm_eps=1e-6",
            "model.tie_embeddings=false",
            "model.block_pattern=mamba2,mamba",
            "model.dtype=bfloat16",
            "model.mamba.dt_rank=none",
            "model.mamba2.dt_limit=(0.001, inf)",
            "model.mamba2.chunk_size=64",
        ],
    )
    assert cfg.seed == 3 and cfg.workdir == "/tmp/run"
    m = cfg.model
    assert (m.d_model, m.norm_eps, m.tie_embeddings, m.dtype) == (128, 1e-6, False, "bfloat16")
    assert m.block_pattern == ("mamba2", "mamba") and m.mamba.dt_rank is None
    assert m.mamba2.dt_limit == (0.001, math.inf) and m.mamba2.chunk_size == 64
    assert config_lib.apply_overrides(cfg, ["model.mamba.dt_rank=5"]).model.mamba.dt_rank == 5


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.d_modle=3", "unknown config key 'model.d_modle'"),
        ("nope=1", "unknown config key 'nope'"),
        ("model.d_model=1.5", "config key 'model.d_model' expects int, got '1.5'"),
        (
            "model.tie_embeddings=maybe",
            "config key 'model.tie_embeddings' expects bool, got 'maybe'",
        ),
        (
            "model.dtype=float8",
            r"config key 'model.dtype' must be one of \('float32', 'bfloat16', 'float16'\)",
        ),
        ("model.mamba2.dt_limit=(1,2,3)", "config key 'model.mamba2.dt_limit' expects"),
        ("model=3", "config key 'model' is a section"),
        ("model.d_model.x=3", "unknown config key 'model.d_model.x'"),
        ("seed", "is not of the form key=value"),
        ("model.block_pattern=mamba,transformer", "unknown mixer kind 'transformer'"),
        (
            "model.block_pattern=mamba,mamba2,mamba,mamba2,mamba",
            r"n_layer=24 must be a multiple of len\(model.block_pattern\)=5",
        ),
        ("optim.peak_lr=-0.001", r"optim.peak_lr must be > 0, got -0.001"),
        ("optim.peak_lr=0", r"optim.peak_lr must be > 0, got 0"),
        ("optim.warmup_steps=-1", r"optim.warmup_steps must be >= 0, got -1"),
        ("optim.hold_steps=-2", r"optim.hold_steps must be >= 0, got -2"),
        ("optim.b1=1.0", r"optim.b1 must be in \[0, 1\), got 1.0"),
        ("optim.b2=-0.5", r"optim.b2 must be in \[0, 1\), got -0.5"),
        ("optim.eps=0", r"optim.eps must be > 0, got 0"),
        ("optim.weight_decay=-0.1", r"optim.weight_decay must be >= 0, got -0.1"),
        ("optim.clip_norm=-1", r"optim.clip_norm must be >= 0 \(0 = off\), got -1"),
    ],
)
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ValueError, match=message):
        config_lib.apply_overrides(Config(), [override])


def test_a_cosine_schedule_ends_between_zero_and_its_peak():
    cosine = ["optim.schedule=warmup_cosine", "optim.peak_lr=0.001"]
    for end in ("-0.0001", "0.002"):
        with pytest.raises(
            ValueError, match=rf"optim.end_lr must be in \[0, optim.peak_lr\], got {end}"
        ):
            config_lib.apply_overrides(Config(), [*cosine, f"optim.end_lr={end}"])
    assert config_lib.apply_overrides(Config(), [*cosine, "optim.end_lr=0"]).optim.end_lr == 0
    # A constant schedule never reads end_lr.
    assert config_lib.apply_overrides(Config(), ["optim.end_lr=5"]).optim.end_lr == 5


def test_json_round_trip(tmp_path):
    cfg = config_lib.apply_overrides(
        Config(), ["model.block_pattern=mamba2,mamba", "model.mamba2.ngroups=2"]
    )
    config_lib.save_json(cfg, tmp_path / "c.json")
    assert config_lib.load_json(Config, tmp_path / "c.json") == cfg
    with pytest.raises(ValueError, match=r"unknown config keys \['model.bogus'\]"):
        config_lib.from_dict(Config, {"model": {"bogus": 1}})


@pytest.mark.parametrize("name, spec", CONFIGS, ids=[name for name, _ in CONFIGS])
def test_every_config_builds(name, spec, tmp_path, monkeypatch):
    # text_lm.py writes its default corpus to runs/data/ under the working directory: here, not
    # into the checkout (where a concurrent run or train.py could be writing the same file).
    monkeypatch.chdir(tmp_path)
    cfg = config_lib.load_config_file(spec)
    assert isinstance(cfg, Config) and dataclasses.is_dataclass(cfg.model)
    count = _param_count(cfg.model)
    if name in RELEASED_PARAMS_M:
        expected = RELEASED_PARAMS_M[name]
        decimals = len(expected.partition(".")[2])
        assert f"{count / 1e6:.{decimals}f}" == expected, f"{name}: {count:,} parameters"


def test_joint_recall_grid():
    path = CONFIG_DIR / "joint_recall.py"
    variants = config_lib.load_config_file(path).model  # the default variant
    assert variants.sparse.pattern == "lsh+ks"
    module_variants = (
        "mamba,none",
        "mamba,d",
        "mamba,sw",
        "mamba,sw+d",
        "mamba,a",
        "mamba,lsh",
        "mamba,ks",
        "mamba,hax",
        "mamba,double",
        "mamba2,none",
        "mamba2,hax",
        "mamba2,double",
        "samba",
    )
    counts = {}
    for variant in module_variants:
        cfg = config_lib.load_config_file(f"{path}:{variant}")
        counts[variant] = _param_count(cfg.model)
    assert config_lib.load_config_file(f"{path}:mamba,sw+d").model.sparse.pattern == "sw+dilated"
    assert config_lib.load_config_file(f"{path}:samba").model.mixer_kinds == (
        "mamba",
        "mlp",
        "swa",
        "mlp",
    )
    # The branch adds few parameters; doubling the width adds many (the paper's fairness argument).
    assert counts["mamba,none"] < counts["mamba,hax"] < counts["mamba,double"]
    with pytest.raises(ValueError, match="unknown joint-recall variant 'mamba,xyz'"):
        config_lib.load_config_file(f"{path}:mamba,xyz")


def test_joint_recall_at_16x_length(monkeypatch):
    """The 16x cells are the grid's cells with 4x contexts and 4x keys per context: 16,514-token
    sequences whose every token fits the vocabulary, the model otherwise the same."""
    # One example drawn, not the whole split into the cache (195 s of CI's two cores).
    monkeypatch.setattr(split_cache, "directory", lambda: None)
    path = CONFIG_DIR / "joint_recall_16x.py"
    for variant in config_lib.load_config_module(path).VARIANTS:
        cfg = config_lib.load_config_file(f"{path}:{variant}")
        short = config_lib.load_config_file(f"{CONFIG_DIR / 'joint_recall.py'}:{variant}")
        jr = cfg.data.joint_recall
        assert (jr.n_context, jr.n_key, jr.max_n_context, jr.max_n_key) == ((20, 64),) * 2 + (
            64,
        ) * 2
        assert row_length(cfg) + 1 == cfg.model.sparse.max_len == 16_514
        assert (
            dataclasses.replace(cfg.model, vocab_size=100, sparse=short.model.sparse) == short.model
        )
        source = make_source(cfg, "valid", "unused")
        row = source[len(source) - 1]
        assert row["inputs"].shape == (16_513,)
        assert 0 <= row["inputs"].min() and row["inputs"].max() < cfg.model.vocab_size
    with pytest.raises(ValueError, match="unknown 16x joint-recall variant 'mamba,hax'"):
        config_lib.load_config_file(f"{path}:mamba,hax")


def test_released_configs_are_all_checked():
    assert set(RELEASED_PARAMS_M) <= set(RELEASED)
    with pytest.raises(ValueError, match="unknown released model 'mamba_9b'"):
        config_lib.load_config_file(f"{CONFIG_DIR / 'released.py'}:mamba_9b")


def test_a_moved_key_is_refused_with_its_new_name_and_read_from_old_files(tmp_path):
    """data.joint_recall.eval_batches limited validation for every task: it is data.eval_batches
    now. The old override names the new key; a config.json (or a checkpoint's config) written
    with the old key is read with the value moved, and a run with it resumes."""
    with pytest.raises(ValueError, match="data.joint_recall.eval_batches is now data.eval_batches"):
        config_lib.apply_overrides(Config(), ["data.joint_recall.eval_batches=2"])
    old = config_lib.to_dict(config_lib.apply_overrides(Config(), ["data.eval_batches=3"]))
    old["data"]["joint_recall"]["eval_batches"] = old["data"].pop("eval_batches")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(old))
    assert config_lib.load_json(Config, path).data.eval_batches == 3
    check_resumable(old, Config(), "old workdir")  # eval_batches may change on resume
    with pytest.raises(ValueError, match=r"data.seq_len: checkpoint 1024 vs now 512"):
        check_resumable(old, config_lib.apply_overrides(Config(), ["data.seq_len=512"]), "x")


def test_combine_all_reduces_moved_to_combine_collectives(tmp_path):
    """mesh.combine_all_reduces limits reduce-scatters and all-gathers too now: the old override
    names mesh.combine_collectives, and a config.json with the old key is read with it moved."""
    with pytest.raises(ValueError, match="combine_all_reduces is now mesh.combine_collectives"):
        config_lib.apply_overrides(Config(), ["mesh.combine_all_reduces=off"])
    old = config_lib.to_dict(Config())
    old["mesh"]["combine_all_reduces"] = "off"
    del old["mesh"]["combine_collectives"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(old))
    assert config_lib.load_json(Config, path).mesh.combine_collectives == "off"
