"""Conversion: logits equal to transformers' on tiny random models; HF -> hax_jax -> HF round trip;
errors."""

import dataclasses
import json
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from flax import nnx  # noqa: E402
from hf_models import hf_mamba, hf_mamba2  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

from hax_jax import LanguageModel, convert, load_pretrained, save_pretrained  # noqa: E402
from hax_jax.config import SparseConfig  # noqa: E402

LOGIT_ATOL = 2e-4  # fp32, the bar


def _tokens(vocab: int, length: int = 21, batch: int = 2, seed: int = 0) -> np.ndarray:
    """Random token ids (b, l); lengths are not a multiple of the chunk sizes used."""
    return np.random.default_rng(seed).integers(0, vocab, (batch, length))


def _hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    """transformers' logits in fp32."""
    with torch.no_grad():
        return model(torch.from_numpy(tokens)).logits.float().numpy()


def _save_hf(model, path, fmt: str):
    """Writes `model` in one of the HF layouts: single or sharded safetensors, or
    pytorch_model.bin."""
    if fmt == "bin":
        path.mkdir(parents=True)
        model.config.save_pretrained(path)
        torch.save(model.state_dict(), path / "pytorch_model.bin")
    else:
        model.save_pretrained(path, max_shard_size="20KB" if fmt == "sharded" else "5GB")
    return path


def _save_mamba_ssm(model, path, *, vocab: int, ssm_cfg: dict):
    """Writes `model` as an original mamba_ssm checkpoint (config.json + pytorch_model.bin)."""
    path.mkdir(parents=True)
    hf = model.config
    config = dict(
        d_model=hf.hidden_size,
        d_intermediate=0,
        n_layer=hf.num_hidden_layers,
        vocab_size=vocab,
        ssm_cfg=ssm_cfg,
        attn_layer_idx=[],
        attn_cfg={},
        rms_norm=True,
        residual_in_fp32=True,
        fused_add_norm=True,
        pad_vocab_size_multiple=8,
        tie_embeddings=hf.tie_word_embeddings,
    )
    (path / "config.json").write_text(json.dumps(config))
    state = {
        k.replace("backbone.embeddings.", "backbone.embedding."): v
        for k, v in model.state_dict().items()
    }
    if hf.tie_word_embeddings:
        state["lm_head.weight"] = state["backbone.embedding.weight"]
    torch.save(state, path / "pytorch_model.bin")
    return path


def _check_parity_and_round_trip(hf_model, src, tmp_path, vocab):
    """CLI convert -> load_pretrained -> logits == HF; --to-hf -> same tensors and logits in
    transformers."""
    out = tmp_path / "hax"
    convert.main([str(src), str(out)])
    model = load_pretrained(out)
    tokens = _tokens(vocab)
    ours = np.asarray(model(jnp.asarray(tokens)))
    np.testing.assert_allclose(ours, _hf_logits(hf_model, tokens), atol=LOGIT_ATOL, rtol=0)

    back = tmp_path / "hf_again"
    convert.main([str(out), str(back), "--to-hf"])
    original = {
        k.replace("embedding.", "embeddings."): v.numpy() for k, v in hf_model.state_dict().items()
    }
    if hf_model.config.tie_word_embeddings:
        original.pop("lm_head.weight", None)
    again = convert.read_tensors(back)
    assert sorted(again) == sorted(original)
    for key, value in original.items():
        np.testing.assert_array_equal(again[key], value, err_msg=key)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(back).eval()
    np.testing.assert_allclose(
        _hf_logits(reloaded, tokens), _hf_logits(hf_model, tokens), atol=1e-6, rtol=0
    )


@pytest.mark.parametrize(
    "kwargs, fmt",
    [
        (dict(conv=4, tie=True), "safetensors"),
        (dict(conv=3, tie=False, bias=True), "sharded"),
        (dict(conv=4, tie=True, vocab=61), "bin"),
    ],
    ids=["tied-safetensors", "conv3-untied-bias-sharded", "odd-vocab-bin"],
)
def test_mamba_matches_transformers(tmp_path, kwargs, fmt):
    hf_model = hf_mamba(tmp_path, **kwargs)
    src = _save_hf(hf_model, tmp_path / "hf", fmt)
    _check_parity_and_round_trip(hf_model, src, tmp_path, kwargs.get("vocab", 64))


@pytest.mark.parametrize(
    "kwargs, fmt",
    [
        (dict(groups=1, conv=4, tie=False, chunk=8), "safetensors"),
        (dict(groups=2, conv=3, tie=True, chunk=4), "sharded"),
        (dict(groups=4, conv=4, tie=False, chunk=16), "bin"),
    ],
    ids=["g1-untied-chunk8", "g2-conv3-tied-chunk4-sharded", "g4-chunk16-bin"],
)
def test_mamba2_matches_transformers(tmp_path, kwargs, fmt):
    hf_model = hf_mamba2(tmp_path, **kwargs)
    src = _save_hf(hf_model, tmp_path / "hf", fmt)
    _check_parity_and_round_trip(hf_model, src, tmp_path, 64)


def test_mamba_ssm_checkpoints_match_transformers(tmp_path):
    # vocab 61 padded to a multiple of 8 gives the 64 embedding rows, as mamba_ssm does for 50277 ->
    # 50280.
    m1 = hf_mamba(tmp_path, vocab=64, seed=1)
    src1 = _save_mamba_ssm(m1, tmp_path / "m1", vocab=61, ssm_cfg={"d_state": 8})
    m2 = hf_mamba2(tmp_path, groups=2, tie=True, chunk=8, seed=2)
    src2 = _save_mamba_ssm(
        m2,
        tmp_path / "m2",
        vocab=61,
        ssm_cfg={"layer": "Mamba2", "d_state": 8, "headdim": 16, "ngroups": 2, "chunk_size": 8},
    )
    for hf_model, src in ((m1, src1), (m2, src2)):
        model = convert.from_pretrained_dir(src)
        assert model.cfg.vocab_size == 61 and model.cfg.padded_vocab_size == 64
        tokens = _tokens(61)
        np.testing.assert_allclose(
            np.asarray(model(jnp.asarray(tokens))),
            _hf_logits(hf_model, tokens),
            atol=LOGIT_ATOL,
            rtol=0,
        )


def test_cli_entry_point(tmp_path):
    hf_model = hf_mamba(tmp_path)
    src = _save_hf(hf_model, tmp_path / "hf", "safetensors")
    out = tmp_path / "hax"
    result = subprocess.run(
        [sys.executable, "-m", "hax_jax.convert", str(src), str(out)],
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"},
    )
    assert result.returncode == 0, result.stderr
    tokens = _tokens(64)
    np.testing.assert_allclose(
        np.asarray(load_pretrained(out)(jnp.asarray(tokens))),
        _hf_logits(hf_model, tokens),
        atol=LOGIT_ATOL,
        rtol=0,
    )


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(convert.ConversionError, match="no config.json"):
        convert.from_pretrained_dir(tmp_path)
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(convert.ConversionError, match="unknown model_type 'llama'"):
        convert.from_pretrained_dir(tmp_path / "llama")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps({"hidden_dim": 3}))
    with pytest.raises(convert.ConversionError, match="not a Mamba config"):
        convert.from_pretrained_dir(tmp_path / "other")

    hf_model = hf_mamba(tmp_path)
    src = _save_hf(hf_model, tmp_path / "hf", "safetensors")
    cfg = convert.read_config(src)
    tensors = convert.read_tensors(src)
    without = {k: v for k, v in tensors.items() if k != "backbone.layers.1.mixer.x_proj.weight"}
    with pytest.raises(
        convert.ConversionError,
        match=r"missing tensors: \['backbone.layers.1.mixer.x_proj.weight'\]",
    ):
        convert.tensors_to_model(cfg, without)
    bad = dict(tensors, **{"backbone.layers.0.mixer.A_log": np.zeros((64, 9), np.float32)})
    with pytest.raises(
        convert.ConversionError,
        match=r"'backbone.layers.0.mixer.A_log' has shape \(64, 9\), "
        r"expected \(64, 8\)",
    ):
        convert.tensors_to_model(cfg, bad)
    extra = dict(tensors, **{"backbone.layers.0.mixer.q_proj.weight": np.zeros((2, 2), np.float32)})
    with pytest.raises(convert.ConversionError, match="unexpected tensors"):
        convert.tensors_to_model(cfg, extra)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(convert.ConversionError, match="holds no weights"):
        convert.from_pretrained_dir(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="not a hax_jax checkpoint"):
        load_pretrained(src)

    model = convert.from_pretrained_dir(src)
    with pytest.raises(ValueError, match=r"token id 64 is out of range \[0, vocab_size=64\)"):
        model(jnp.array([[1, 64]]))
    with pytest.raises(ValueError, match="token id -1"):
        model(jnp.array([[1, -1]]))
    with pytest.raises(ValueError, match="tokens must be integer with 2 axes"):
        model(jnp.zeros((2, 3)))


def _hax_model_dir(tmp_path):
    """A tiny HAX-Mamba-2 (the HF Mamba-2 config with an lsh+ks branch), saved as ours."""
    src = _save_hf(hf_mamba2(tmp_path), tmp_path / "hf", "safetensors")
    sparse = SparseConfig(pattern="lsh+ks", num_keys=8, max_len=64)
    cfg = dataclasses.replace(convert.read_config(src), sparse=sparse)
    model = LanguageModel(cfg, rngs=nnx.Rngs(3))
    save_pretrained(model, tmp_path / "hax")
    return tmp_path / "hax", model


def test_to_hf_refuses_the_sparse_branch_unless_told_to_drop_it(tmp_path, capsys):
    """HF has no sparse branch: --to-hf refuses a HAX model, naming the pattern and the flag,
    and writes nothing; --drop-sparse-branch writes the SSM with a warning, transformers loads
    it, and converting it back gives every SSM parameter unchanged."""
    src, model = _hax_model_dir(tmp_path)
    out = tmp_path / "hf_out"
    with pytest.raises(SystemExit) as exit_:
        convert.cli([str(src), str(out), "--to-hf"])
    message = str(exit_.value.code)
    assert message.startswith("error: the model has a HAX sparse branch")
    assert "model.sparse.pattern='lsh+ks'" in message and "--drop-sparse-branch" in message
    assert not out.exists()

    convert.cli([str(src), str(out), "--to-hf", "--drop-sparse-branch"])
    assert "warning: dropped the sparse branch (model.sparse.pattern='lsh+ks')" in (
        capsys.readouterr().err
    )
    tokens = _tokens(64)
    back = convert.from_pretrained_dir(out)
    assert not back.cfg.sparse.pattern
    np.testing.assert_allclose(
        np.asarray(back(jnp.asarray(tokens))),
        _hf_logits(transformers.AutoModelForCausalLM.from_pretrained(out).eval(), tokens),
        atol=LOGIT_ATOL,
        rtol=0,
    )
    ours = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    again = nnx.to_pure_dict(nnx.state(back, nnx.Param))
    flat = dict(jax.tree_util.tree_flatten_with_path(ours)[0])
    for path, value in jax.tree_util.tree_flatten_with_path(again)[0]:
        np.testing.assert_array_equal(value, flat[path], err_msg=jax.tree_util.keystr(path))
    dropped = [p for p in flat if "branch" in jax.tree_util.keystr(p)]
    assert dropped and len(flat) == len(jax.tree.leaves(again)) + len(dropped)


def test_command_line_failures_are_one_error_line(tmp_path):
    """Every failure of the command line is `error: ...` naming the file or value, no traceback."""
    src = _save_hf(hf_mamba(tmp_path), tmp_path / "hf", "safetensors")

    def error(*argv):
        with pytest.raises(SystemExit) as exit_:
            convert.cli([str(a) for a in argv])
        return str(exit_.value.code)

    def broken(name, edit):
        """A copy of the HF directory with one thing edited."""
        path = tmp_path / name
        shutil.copytree(src, path)
        edit(path)
        return path

    out = tmp_path / "out"
    assert (
        error(tmp_path / "nowhere", out)
        == f"error: {str(tmp_path / 'nowhere')!r} is not a directory"
    )
    assert "not a hax_jax checkpoint" in error(tmp_path / "nowhere", out, "--to-hf")
    no_config = broken("no_config", lambda p: (p / "config.json").unlink())
    assert error(no_config, out).endswith("is not a Mamba checkpoint: it has no config.json")
    llama = broken("llama", lambda p: (p / "config.json").write_text('{"model_type": "llama"}'))
    assert "unknown model_type 'llama'" in error(llama, out)
    bad_json = broken("bad_json", lambda p: (p / "config.json").write_text('{"model_type": '))
    assert f"{str(bad_json / 'config.json')!r} is not valid JSON" in error(bad_json, out)

    def truncate(path):
        weights = path / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])

    cut = broken("cut", truncate)
    weights = str(cut / "model.safetensors")
    assert f"{weights!r} is not a readable safetensors file" in error(cut, out)
    tensors = convert.read_tensors(src)

    def rewrite(changed):
        return lambda p: save_file(changed, p / "model.safetensors", metadata={"format": "pt"})

    key = "backbone.layers.0.mixer.A_log"
    wrong = broken("wrong", rewrite({**tensors, key: np.zeros((64, 9), np.float32)}))
    assert f"{key!r} has shape (64, 9), expected (64, 8)" in error(wrong, out)
    missing = broken("missing", rewrite({k: v for k, v in tensors.items() if k != key}))
    assert f"missing tensors: [{key!r}]" in error(missing, out)
    assert not out.exists()
    # As a user runs it: one line on stderr, exit status 1.
    run = subprocess.run(
        [sys.executable, "-m", "hax_jax.convert", str(cut), str(out)],
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"},
    )
    assert run.returncode == 1 and run.stderr.strip().splitlines() == [error(cut, out)], run.stderr
