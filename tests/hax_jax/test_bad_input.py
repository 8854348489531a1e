"""Issue 19: bad user input raises a ValueError (FileNotFoundError) naming the argument and its
value."""

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hax_jax
from hax_jax import config as config_lib
from hax_jax.config import Mamba2Config, ModelConfig

TINY = Path(__file__).parents[2] / "configs" / "tiny.py"


@pytest.fixture(scope="module")
def model() -> hax_jax.LanguageModel:
    """One Mamba-2 layer, d_model 16: the checks run before any real work."""
    cfg = ModelConfig(
        d_model=16,
        n_layer=1,
        vocab_size=50,
        block_pattern=("mamba2",),
        mamba2=Mamba2Config(d_state=8, headdim=8, chunk_size=8),
    )
    return hax_jax.LanguageModel(cfg, rngs=nnx.Rngs(0))


def _prompts() -> np.ndarray:
    """Two prompts of five tokens."""
    return np.random.default_rng(0).integers(1, 50, (2, 5))


def test_model_takes_int_lists_and_names_a_float_dtype(model):
    tokens = [[1, 2, 3], [4, 5, 6]]
    want = np.asarray(model(jnp.asarray(tokens)))
    np.testing.assert_array_equal(np.asarray(model(tokens)), want)
    np.testing.assert_array_equal(np.asarray(model(np.asarray(tokens, np.int64))), want)
    with pytest.raises(
        ValueError, match=r"tokens must be integer with 2 axes, got float64 \(1, 2\)"
    ):
        model([[1.0, 2.0]])
    with pytest.raises(ValueError, match="tokens must be an integer array, got list"):
        model([[1, 2], [3]])


def test_generate_refuses_an_empty_batch(model):
    with pytest.raises(ValueError, match=r"at least one prompt, got batch size 0 \(0, 5\)"):
        hax_jax.generate(model, np.zeros((0, 5), np.int32), 3)


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((2.0,), {}, r"max_new_tokens=2\.0 must be a positive int"),
        ((True,), {}, "max_new_tokens=True must be a positive int"),
        ((3,), {"temperature": "hot"}, "temperature='hot' must be a number >= 0"),
        ((3,), {"temperature": float("nan")}, "temperature=nan must be a number >= 0"),
        ((3,), {"top_k": 2.5}, r"top_k=2\.5 must be an int >= 0"),
        ((3,), {"top_p": None}, r"top_p=None must be a number in \(0, 1\]"),
        ((3,), {"stop_tokens": [1.5]}, r"stop_tokens must be int ids, got \[1\.5\]"),
    ],
)
def test_generate_names_a_bad_argument(model, args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        hax_jax.generate(model, _prompts(), *args, **kwargs)


def test_generate_stop_tokens_none_means_none(model):
    default = hax_jax.generate(model, _prompts(), 4)
    none = hax_jax.generate(model, _prompts(), 4, stop_tokens=None)
    np.testing.assert_array_equal(none.tokens, default.tokens)
    np.testing.assert_array_equal(none.lengths, [4, 4])


def test_load_pretrained_names_a_bad_or_missing_config(tmp_path):
    (tmp_path / "params").mkdir()  # config.json is read before the parameters
    config = tmp_path / "config.json"
    config.write_text('{"d_model": 16,,}')
    with pytest.raises(ValueError, match=rf"'{config}' is not valid JSON: .* line 1 column 16"):
        hax_jax.load_pretrained(tmp_path)
    config.unlink()
    with pytest.raises(FileNotFoundError, match=rf"'{tmp_path}' .*config\.json is missing"):
        hax_jax.load_pretrained(tmp_path)


def test_load_pretrained_names_parameters_its_config_does_not_hold(model, tmp_path):
    """Parameters that do not fit the config.json beside them (another model's, or an older
    layout's) are named, not left to orbax's tree mismatch."""
    hax_jax.save_pretrained(model, tmp_path)
    other = config_lib.apply_overrides(model.cfg, ["mamba2.d_state=16"])
    config_lib.save_json(other, tmp_path / "config.json")
    with pytest.raises(
        ValueError, match=r"in_proj/kernel/B has shape \(16, 1, 8\) there, \(16, 1, 16\) here"
    ):
        hax_jax.load_pretrained(tmp_path)


@pytest.mark.parametrize(
    "override",
    [
        "data.joint_recall.valid_size=0",
        "data.joint_recall.train_size=0",
        "data.mqar.valid_size=0",
        "data.mqar.stage_examples=0",
    ],
)
def test_empty_data_splits_are_refused_with_the_key(override):
    key, value = override.split("=")
    with pytest.raises(ValueError, match=rf"{key} must be positive, got {value}"):
        config_lib.apply_overrides(config_lib.load_config_file(TINY), [override])
