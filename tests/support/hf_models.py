"""Tiny random transformers Mamba / Mamba-2 models, the references of the conversion and eval
tests."""

import inspect

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def randomize(model, seed: int):
    """Moves every parameter off its init (ones, zeros, aranges) so no mapping error can hide."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen))
    return model.eval()


def hf_mamba(tmp_path, *, conv=4, tie=True, bias=False, vocab=64, seed=0):
    """A tiny random MambaForCausalLM."""
    cfg = transformers.MambaConfig(
        hidden_size=32,
        state_size=8,
        num_hidden_layers=2,
        vocab_size=vocab,
        conv_kernel=conv,
        expand=2,
        use_bias=bias,
        tie_word_embeddings=tie,
        use_mambapy=False,
    )
    torch.manual_seed(seed)
    return randomize(transformers.MambaForCausalLM(cfg), seed)


def hf_groups_its_norm() -> bool:
    """Whether this transformers' Mamba2 gated RMSNorm is grouped like mamba_ssm's (fixed after
    5.17)."""
    from transformers.models.mamba2 import modeling_mamba2

    return "group_size" in inspect.signature(modeling_mamba2.MambaRMSNormGated.__init__).parameters


def hf_mamba2(tmp_path, *, groups=1, conv=4, tie=False, chunk=8, vocab=64, seed=0):
    """A tiny random Mamba2ForCausalLM (4 heads of 16)."""
    if groups > 1 and not hf_groups_its_norm():
        pytest.skip(
            f"transformers {transformers.__version__} normalises Mamba2 over all groups at once; "
            "mamba_ssm (and hax_jax) normalise each group: no reference for n_groups > 1"
        )
    cfg = transformers.Mamba2Config(
        hidden_size=32,
        expand=2,
        num_heads=4,
        head_dim=16,
        state_size=8,
        n_groups=groups,
        num_hidden_layers=2,
        vocab_size=vocab,
        conv_kernel=conv,
        chunk_size=chunk,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    return randomize(transformers.Mamba2ForCausalLM(cfg), seed)
