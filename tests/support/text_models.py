"""A tiny model with a tokenizer, saved as a checkpoint directory: the subject of the text-task
tests."""

import shutil
from pathlib import Path

from flax import nnx
from mixer_testing import perturbed

from hax_jax import ModelConfig, save_pretrained
from hax_jax.config import Mamba2Config
from hax_jax.data import text
from hax_jax.models.lm import LanguageModel


def pydoc_tokenizer(root: Path, vocab_size: int):
    """(a BPE of vocab_size ids trained on pydoc's topics, the topics text file), both under
    root."""
    corpus = text.write_pydoc_topics(root / "topics.txt")
    text.train_tokenizer([corpus], root / "tok", vocab_size)
    return text.load_tokenizer(root / "tok"), corpus


def small_mamba2(vocab_size: int) -> LanguageModel:
    """A 2-layer Mamba-2 (d_model 32, d_state 8, heads of 8, chunks of 16) over vocab_size tokens,
    its parameters moved off their init."""
    cfg = ModelConfig(
        d_model=32,
        n_layer=2,
        vocab_size=vocab_size,
        block_pattern=("mamba2",),
        mamba2=Mamba2Config(d_state=8, headdim=8, chunk_size=16),
    )
    return perturbed(LanguageModel(cfg, rngs=nnx.Rngs(0)), seed=1, scale=0.2)


def tiny_text_model(root: Path) -> dict:
    """A perturbed 2-layer Mamba-2 over a 512-token BPE of pydoc's topics, saved in root/ckpt with
    its tokenizer.json: {"model", "ckpt", "corpus", "tokenizer"}."""
    tokenizer, corpus = pydoc_tokenizer(root, 512)
    model = small_mamba2(512)
    save_pretrained(model, root / "ckpt")
    shutil.copy(root / "tok" / "tokenizer.json", root / "ckpt" / "tokenizer.json")
    return {
        "model": model,
        "ckpt": root / "ckpt",
        "corpus": corpus,
        "tokenizer": tokenizer,
    }
