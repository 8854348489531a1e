"""model.init="hax_code": the HAX code's initial parameters (DeepGraphLearning/HAX's
configs/*.json, initializer_range 0.1, through flash-linear-attention v0.2.0's _init_weights),
rule by rule, written out here from that code rather than from layers/init.py: what it re-draws
has the stated distribution, what it keeps equals the default (mamba_ssm) model of the same seed."""

import jax
import numpy as np
import pytest
from flax import nnx

from hax_jax.config import apply_overrides, load_config_file
from hax_jax.models.lm import LanguageModel

STD = 0.1  # the HAX configs' initializer_range


def params(variant: str, *overrides: str) -> dict[str, np.ndarray]:
    """The joint-recall cell's parameters by path ("layers/0/mixer/in_proj/kernel/x")."""
    cfg = apply_overrides(load_config_file(f"configs/joint_recall.py:{variant}"), overrides)
    state = nnx.state(LanguageModel(cfg.model, rngs=nnx.Rngs(0)), nnx.Param)
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        names = [str(getattr(p, "key", getattr(p, "idx", p))) for p in path]
        out["/".join(n for n in names if "value" not in n)] = np.asarray(leaf)
    return out


# Per base: the parameters (path patterns below layers/i/mixer/) the HAX code draws normal with
# std 0.1, sets to 0, or leaves as the official init (equal to ours). Everything else, the norms
# and D included, is the official init too. Mamba-2's A_log is log(1..n_heads), checked apart.
RULES = {
    "mamba2": {
        "normal": ["in_proj/kernel/", "conv1d/kernel/", "branch/qk_proj/kernel", "fc1/kernel"],
        "zero": ["conv1d/bias/", "branch/scorer/fc1/bias", "branch/scorer/fc2/bias"],
        "kept": ["out_proj/kernel", "dt_bias", "/D", "norm/weight", "branch/E"],
    },
    "mamba": {
        "normal": ["in_proj/kernel/", "x_proj/kernel", "out_proj/kernel", "branch/qk_proj"],
        "zero": ["branch/scorer/fc1/bias", "branch/scorer/fc3/bias"],
        "kept": ["conv1d/kernel", "conv1d/bias", "dt_proj/kernel", "dt_proj/bias", "A_log", "/D"],
    },
}


@pytest.mark.parametrize("base", ["mamba2", "mamba"])
def test_hax_code_init_follows_the_hax_code(base):
    ours = params(f"{base},hax")
    theirs = params(f"{base},hax", "model.init=hax_code")
    assert ours.keys() == theirs.keys()
    checked = set()
    for layer in ("layers/0/mixer/", "layers/1/mixer/"):
        for rule, patterns in RULES[base].items():
            for pattern in patterns:
                names = [n for n in theirs if n.startswith(layer) and pattern in n]
                assert names, f"{layer}{pattern} matches no parameter"
                for name in names:
                    value = theirs[name]
                    if rule == "kept":
                        np.testing.assert_array_equal(value, ours[name], err_msg=name)
                    elif rule == "zero":
                        assert np.all(value == 0) and not np.all(ours[name] == 0), name
                    else:
                        assert not np.array_equal(value, ours[name]), name
                        assert abs(value.mean()) < 0.3 * STD, name
                        if value.size >= 1000:  # the sample std within 10%
                            assert abs(value.std() / STD - 1) < 0.1, (name, value.std())
                    checked.add(name)
    embedding = theirs["embedding/embedding"]
    assert abs(embedding.std() / STD - 1) < 0.1
    assert abs(ours["embedding/embedding"].std() - 0.02) < 2e-3
    for name in set(theirs) - checked - {"embedding/embedding"}:
        if base == "mamba2" and name.endswith("A_log"):
            np.testing.assert_array_equal(theirs[name], np.log(np.arange(1, 9, dtype=np.float32)))
        elif "scorer" in name and ("kernel" in name or "bias" in name):
            # the scorer's remaining layers (fc2 / fc3 kernels, fc2 / fc3 biases): 0.1-normal or 0
            assert np.all(theirs[name] == 0) or abs(theirs[name].std() / STD - 1) < 0.5, name
        else:  # block norms, norm_f and any parameter no rule above names: the official init
            np.testing.assert_array_equal(theirs[name], ours[name], err_msg=name)


def test_hax_code_init_refuses_layers_it_does_not_cover():
    with pytest.raises(ValueError, match=r"model.init='hax_code' covers mamba and mamba2 .*'mlp'"):
        params("samba", "model.init=hax_code")
