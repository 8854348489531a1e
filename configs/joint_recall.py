"""The HAX paper's multi-query joint-recall grid (§5.1, App. D.1):
`configs/joint_recall.py:<variant>`.

Variants: `<base>,<sparse>` with base in {mamba, mamba2} and sparse in SPARSE below (the paper's
names); `<base>,double` (no branch, doubled width, for a fair parameter count); and `samba`. Widths
follow the HAX code's configs (d_model 64, 2 layers; Mamba d_state 16, Mamba-2 d_state 32 with 8
heads of 16). Samba uses d_model 64 and window 64 as the paper states (the code's samba.json says
hidden_size 32). PAPER_ACCURACY holds the paper's Table 1 for `python -m hax_jax.sweep
configs/joint_recall.py`. Initialisation and optimizer follow mamba_ssm and the paper; the HAX
code's own start and the effect of its AdamW on bf16 parameters (RESULTS.md) are the overrides
`model.init=hax_code optim.frozen=(A_log,dt_bias) optim.clip_norm=0` (Mamba and Mamba-2 cells).
"""

import dataclasses

from hax_jax.config import (
    AttentionConfig,
    Config,
    Mamba2Config,
    MambaConfig,
    MlpConfig,
    ModelConfig,
    SparseConfig,
)

# The paper's sparse variants -> our patterns; every one has num_keys 64 in total.
SPARSE = {
    "none": "",
    "d": "dilated",
    "sw": "sw",
    "sw+d": "sw+dilated",
    "a": "sw+sink",
    "lsh": "lsh",
    "ks": "ks",
    "hax": "lsh+ks",
}
VARIANTS = tuple(
    f"{base},{name}" for base in ("mamba", "mamba2") for name in (*SPARSE, "double")
) + ("samba",)
# The paper's Table 1: joint-recall test accuracy (%) of each cell (2 layers, d_model 64).
_TABLE_1 = {  # columns: none d sw sw+d a lsh ks hax double
    "mamba": (16.3, 7.8, 18.7, 16.6, 16.4, 11.6, 36.6, 38.0, 34.5),
    "mamba2": (36.6, 19.6, 70.6, 48.6, 49.3, 13.5, 60.1, 74.3, 59.2),
}
PAPER_ACCURACY = {
    f"{base},{name}": value
    for base, row in _TABLE_1.items()
    for name, value in zip((*SPARSE, "double"), row, strict=True)
} | {"samba": 6.3}


def _base(d_model: int, base: str) -> ModelConfig:
    """The HAX code's 2-layer Mamba / Mamba-2 on the joint-recall vocabulary (100 tokens, tied
    embeddings)."""
    return ModelConfig(
        d_model=d_model,
        n_layer=2,
        vocab_size=100,
        pad_vocab_size_multiple=1,
        block_pattern=(base,),
        tie_embeddings=True,  # the HAX trainer's logits use the embedding matrix
        # The HAX trainer runs the model in bf16 (here: bf16 compute, fp32 params).
        dtype="bfloat16",
        residual_in_fp32=base == "mamba2",
        mamba=MambaConfig(d_state=16, dt_rank=8),
        mamba2=Mamba2Config(d_state=32, headdim=d_model // 4, chunk_size=256),
        # sign-bit LSH with h = 8, resampled every step; dilation from the padded length 1058.
        sparse=SparseConfig(
            num_keys=64, hash_bits=8, binning="sign", max_len=1058, rank_loss_weight=0.1
        ),
    )


def get_config(variant: str = "mamba,hax") -> Config:
    """One cell of the grid."""
    if variant == "samba":
        model = dataclasses.replace(
            _base(64, "mamba"),
            n_layer=4,
            block_pattern=("mamba", "mlp", "swa", "mlp"),
            attention=AttentionConfig(n_heads=4, window=64),
            mlp=MlpConfig(hidden_ratio=4.0),
        )
        return Config(model=model)
    base, _, name = variant.partition(",")
    if base not in ("mamba", "mamba2") or name not in (*SPARSE, "double"):
        raise ValueError(f"unknown joint-recall variant {variant!r}; known: {VARIANTS}")
    if name == "double":
        return Config(model=_base(128, base))
    model = _base(64, base)
    return Config(
        model=dataclasses.replace(
            model, sparse=dataclasses.replace(model.sparse, pattern=SPARSE[name])
        )
    )
