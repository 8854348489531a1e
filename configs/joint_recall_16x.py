"""Joint recall at 16x the HAX paper's length (past where its code can go):
`configs/joint_recall_16x.py:<variant>`.

The grid's cells (configs/joint_recall.py: same widths, 2 layers, sparse branches of 64 keys), with
contexts per example and keys per context both scaled 4x: n_context and n_key uniform in [20, 64],
so a padded sequence is (2 x 64)(2 x 64 + 1) + 2 = 16,514 tokens against the paper's 1,058. The
vocabulary grows to hold the new context and key tokens; the 16 values stay. Validation draws 2,048
examples (the paper's 14,400 would be 238M tokens an evaluation). Cells: Mamba-2 without a branch,
with a 64-key sliding window, and with HAX: `python -m hax_jax.sweep configs/joint_recall_16x.py`.
"""

import dataclasses
from pathlib import Path

from hax_jax.config import load_config_file
from hax_jax.data.joint_recall import VALUE_OFFSET, padded_length

SCALE = 4  # contexts and keys per context: 4 x 4 = 16x the tokens
VARIANTS = ("mamba2,none", "mamba2,sw", "mamba2,hax")
VALID_SIZE = 2_048


def get_config(variant: str = "mamba2,hax"):
    """One cell of configs/joint_recall.py at 16x its sequence length."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown 16x joint-recall variant {variant!r}; known: {VARIANTS}")
    cfg = load_config_file(f"{Path(__file__).with_name('joint_recall.py')}:{variant}")
    jr = cfg.data.joint_recall
    jr = dataclasses.replace(
        jr,
        n_context=tuple(SCALE * n for n in jr.n_context),
        n_key=tuple(SCALE * n for n in jr.n_key),
        max_n_context=SCALE * jr.max_n_context,
        max_n_key=SCALE * jr.max_n_key,
        valid_size=VALID_SIZE,
    )
    vocab = VALUE_OFFSET + jr.n_value + jr.max_n_key + jr.max_n_context  # every token id below it
    model = dataclasses.replace(
        cfg.model,
        vocab_size=-(-vocab // 8) * 8,
        sparse=dataclasses.replace(
            cfg.model.sparse, max_len=padded_length(jr.max_n_context, jr.max_n_key)
        ),
    )
    return dataclasses.replace(
        cfg, model=model, data=dataclasses.replace(cfg.data, joint_recall=jr)
    )
