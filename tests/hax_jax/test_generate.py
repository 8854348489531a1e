"""generate (cached decode) against generate_reference (a full forward per step), every mixer
kind."""

import importlib

import jax
import numpy as np
import pytest
from flax import nnx
from jaxprs import equations, sub_jaxprs
from mixer_testing import perturbed

from hax_jax.config import (
    AttentionConfig,
    InfiniConfig,
    Mamba2Config,
    MambaConfig,
    ModelConfig,
    SparseConfig,
)
from hax_jax.generate import Sampling, generate, generate_reference, sample
from hax_jax.layers.fused import FusedLinear
from hax_jax.layers.linear import Linear
from hax_jax.models.lm import LanguageModel

# The module: the package's hax_jax.generate is the function.
generation = importlib.import_module("hax_jax.generate")
TOL = {"rtol": 2e-5, "atol": 2e-5}  # fp32 throughout

# (block pattern, sparse branch): every mixer kind, and HAX on both SSMs.
MODELS = {
    "mamba": (("mamba",), ""),
    "mamba2": (("mamba2",), ""),
    "attention+mlp": (("attention", "mlp"), ""),
    "swa": (("swa",), ""),
    "infini": (("infini",), ""),
    "hax-mamba": (("mamba",), "lsh+ks"),
    "hax-mamba2": (("mamba2",), "lsh+ks"),
}


def _model(name: str, seed: int = 0) -> LanguageModel:
    """A 2-layer model whose windows and segments are shorter than the generated text."""
    pattern, sparse = MODELS[name]
    cfg = ModelConfig(
        d_model=32,
        n_layer=2,
        vocab_size=50,
        block_pattern=pattern,
        mamba=MambaConfig(d_state=8),
        mamba2=Mamba2Config(d_state=8, headdim=8, chunk_size=8),
        attention=AttentionConfig(n_heads=2, window=4),
        infini=InfiniConfig(n_heads=2, segment_len=4),
        sparse=SparseConfig(pattern=sparse, num_keys=8, hash_bits=3),
    )
    return perturbed(LanguageModel(cfg, rngs=nnx.Rngs(seed)), seed=seed + 1, scale=0.3)


def _batch():
    """Three prompts: full, left-padded by 4, right-padded by 3."""
    tokens = np.random.default_rng(0).integers(1, 50, (3, 12))
    mask = np.ones((3, 12), bool)
    mask[1, :4] = False
    mask[2, 9:] = False
    return tokens, mask


@pytest.mark.parametrize("name", list(MODELS))
def test_cached_decode_equals_full_forward(name):
    """generate's tokens and logits are generate_reference's on _batch(), 9 new tokens."""
    model = _model(name)
    tokens, mask = _batch()
    args = dict(mask=mask, return_logits=True)
    fast = generate(model, tokens, 9, **args)
    slow = generate_reference(model, tokens, 9, **args)
    np.testing.assert_array_equal(fast.tokens, slow.tokens)
    np.testing.assert_allclose(fast.logits, slow.logits, **TOL)
    assert len(set(fast.tokens.ravel().tolist())) > 3  # the model is not stuck on one token


@pytest.mark.parametrize("name", ["mamba", "hax-mamba2"])
def test_the_decode_loop_reads_kernels_copied_rows_first_before_it(name, monkeypatch):
    """The decode loop's matmuls read each Linear's kernel, and each in_proj's parts joined, from
    copies stored (out, in) made before the loop: not (in, out), read column by column (on an H200,
    XLA made those one-row matmuls a multiply and a column reduction), and not joined again each
    token (on a GPU, XLA left such a join inside the loop: 42% of a 2.7B token)."""
    model = _model(name)
    traced, decode = [], generation._decode_program()

    def tracing(*args, **kwargs):
        traced.append(decode.trace(*args, **kwargs).jaxpr.jaxpr)
        return decode(*args, **kwargs)

    monkeypatch.setattr(generation, "_decode_program", lambda: tracing)
    generate(model, _batch()[0], 3)
    # (in, out) of every kernel the step multiplies by; not the scorer's last layer, which the
    # step hands to the sparse attention as a LinearScore of its copy's one row.
    kernels = {
        *(
            m.kernel[...].shape
            for path, m in nnx.iter_graph(model)
            if isinstance(m, Linear) and path[-2:] != ("scorer", "fc3")
        ),
        *(
            (m.kernel[m.parts[0].name].shape[0], sum(p.size for p in m.parts))
            for _, m in nnx.iter_graph(model)
            if isinstance(m, FusedLinear)
        ),
    }
    (loop,) = [e for e in traced[-1].eqns if e.primitive.name == "while"]
    inside = [e for sub in sub_jaxprs(loop) for e in equations(sub)]
    read = {}  # (rhs shape, rhs contracting dims) of the loop's matmuls by a 2-D operand
    for e in inside:
        if e.primitive.name == "dot_general" and e.invars[1].aval.ndim == 2:
            shape = tuple(e.invars[1].aval.shape)
            read.setdefault(shape, set()).add(e.params["dimension_numbers"][0][1])
    assert len(kernels) >= 3
    for n_in, n_out in kernels:
        assert (1,) in read.get((n_out, n_in), set()), (n_in, n_out, read)
        assert (0,) not in read.get((n_in, n_out), set()), (n_in, n_out, read)
    concatenated = {
        tuple(e.outvars[0].aval.shape) for e in inside if e.primitive.name == "concatenate"
    }
    assert concatenated, "the loop joins nothing at all: the search found no concatenate in it"
    assert not concatenated & (kernels | {(n_out, n_in) for n_in, n_out in kernels})


def test_padding_side_and_batching_do_not_change_a_row():
    model = _model("hax-mamba2")
    tokens, mask = _batch()
    batched = generate(model, tokens, 6, mask=mask, return_logits=True)
    for i in (1, 2):  # left- and right-padded
        alone = generate(model, tokens[i][mask[i]][None], 6, return_logits=True)
        np.testing.assert_array_equal(batched.tokens[i], alone.tokens[0])
        np.testing.assert_allclose(batched.logits[i], alone.logits[0], **TOL)


def test_stop_tokens_end_rows_and_pad_them():
    model = _model("mamba2")
    tokens, mask = _batch()
    free = generate(model, tokens, 8, mask=mask)
    stop = int(free.tokens[0, 2])
    first = [int(np.flatnonzero(row == stop)[0]) + 1 if stop in row else 8 for row in free.tokens]
    stopped = generate(model, tokens, 8, mask=mask, stop_tokens=[stop], pad_id=-1)
    np.testing.assert_array_equal(stopped.lengths, first)
    for row, free_row, n in zip(stopped.tokens, free.tokens, first):
        np.testing.assert_array_equal(row[:n], free_row[:n])
        assert np.all(row[n:] == -1)


def test_sampling_is_seeded_and_filters():
    model = _model("attention+mlp")
    tokens, mask = _batch()
    warm = dict(mask=mask, temperature=1.5)
    a, b = generate(model, tokens, 8, seed=1, **warm), generate(model, tokens, 8, seed=1, **warm)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert np.any(a.tokens != generate(model, tokens, 8, seed=2, **warm).tokens)
    greedy = generate(model, tokens, 8, mask=mask)
    for narrow in ({"top_k": 1}, {"top_p": 1e-6}):
        np.testing.assert_array_equal(
            generate(model, tokens, 8, **warm, **narrow).tokens, greedy.tokens
        )
    fast = generate(model, tokens, 8, seed=3, top_k=5, top_p=0.8, **warm)
    slow = generate_reference(model, tokens, 8, seed=3, top_k=5, top_p=0.8, **warm)
    np.testing.assert_array_equal(fast.tokens, slow.tokens)


def test_sample_filters_against_numpy():
    logits = jax.random.normal(jax.random.key(0), (4, 30)) * 3
    keys = jax.random.split(jax.random.key(1), 400)
    draw = jax.jit(lambda key: sample(logits, key, Sampling(1.0, 4, 0.7)))
    draws = np.stack([draw(k) for k in keys[:200]])
    for row in range(4):
        probs = np.exp(np.asarray(logits[row]) - np.max(np.asarray(logits[row])))
        probs /= probs.sum()
        order = np.argsort(-probs)
        top = order[:4]
        renorm = probs[top] / probs[top].sum()
        allowed = set(top[: int(np.searchsorted(np.cumsum(renorm), 0.7) + 1)].tolist())
        assert set(draws[:, row].tolist()) <= allowed
        assert len(set(draws[:, row].tolist())) == len(allowed)  # each allowed token comes up
    np.testing.assert_array_equal(
        sample(logits, keys[0], Sampling()), np.argmax(np.asarray(logits), axis=-1)
    )


def test_long_generation_on_cpu():
    """A 4K-token prompt through the HAX model's caches (the branch's cache holds every key)."""
    model = _model("hax-mamba2")
    prompt = np.random.default_rng(1).integers(1, 50, (1, 4100))
    out = generate(model, prompt, 16)
    assert out.tokens.shape == (1, 16) and out.lengths[0] == 16


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_new_tokens": 0}, "max_new_tokens=0"),
        ({"temperature": -1.0}, "temperature=-1.0"),
        ({"top_p": 0.0}, "top_p=0.0"),
        ({"top_k": -2}, "top_k=-2"),
        ({"mask": np.zeros((3, 12), bool)}, "row 0 has no real token"),
        ({"mask": np.tile([True, False, True] * 4, (3, 1))}, "not one contiguous run"),
        ({"tokens": np.full((3, 12), 50)}, "token id 50 is out of range"),
        ({"tokens": np.zeros(12, np.int32)}, "tokens must be integer"),
    ],
)
def test_bad_input_is_named(kwargs, match):
    model = _model("mamba2")
    args = {"tokens": _batch()[0], "max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        generate(model, **args)
