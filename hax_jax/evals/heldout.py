"""Held-out data through the parallel forward: joint recall, MQAR and perplexity.

Joint recall's metric is the HAX paper's: per example, the fraction of inquiry positions predicted
right, averaged over examples. MQAR reports Zoology's token-level accuracy over all query positions
(and the per-example mean beside it). Perplexity is exp(mean NLL) over every predicted token of a
token or text file, cut into rows of seq_len (+1 label) tokens; each row starts without context.
"""

import dataclasses
import functools
import tempfile
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from hax_jax import training
from hax_jax.config import Config
from hax_jax.data import pipeline, text
from hax_jax.models.lm import LanguageModel

SPLITS = ("valid", "test")
TOKEN_SUFFIXES = (".npy", ".bin")  # token files; anything else is read as text


def recall(
    model: LanguageModel, cfg: Config, task: str, *, split: str = "valid", batch_size: int = 0
) -> dict:
    """Accuracy and loss of `model` on the `split` of `task` ("joint_recall" or "mqar").

    The task's settings (sizes, seeds) are cfg.data.joint_recall / cfg.data.mqar; batch_size 0 keeps
    cfg.data.batch_size.
    """
    if task not in ("joint_recall", "mqar"):
        raise ValueError(f"unknown synthetic task {task!r}; known: joint_recall, mqar")
    if split not in SPLITS:
        raise ValueError(f"split={split!r} must be one of {SPLITS}")
    totals = _sums(model, cfg, task=task, split=split, batch_size=batch_size)
    per_example = totals["accuracy_sum"] / max(totals["rows"], 1.0)
    token_level = totals["hits"] / max(totals["tokens"], 1.0)
    return {
        "accuracy": per_example if task == "joint_recall" else token_level,
        **({"example_accuracy": per_example} if task == "mqar" else {}),
        "loss": totals["nll_sum"] / max(totals["tokens"], 1.0),
        "examples": int(totals["rows"]),
        "split": split,
    }


def perplexity(
    model: LanguageModel,
    path: str | Path,
    *,
    seq_len: int,
    batch_size: int,
    tokenizer=None,
    token_dtype: str = "uint16",
) -> dict:
    """exp(mean NLL) over the tokens of `path`: a .npy / raw .bin token file, or text
    (`tokenizer`)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"perplexity data {str(path)!r} does not exist")
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        if path.suffix not in TOKEN_SUFFIXES:
            if tokenizer is None:
                raise ValueError(f"perplexity on the text file {str(path)!r} needs a tokenizer")
            path = text.tokenize_file(
                path, tokenizer, Path(tmp) / "tokens.npy", text.eos_id(tokenizer)
            )
        data = {
            "task": "tokens",
            "path": str(path),
            "valid_path": str(path),
            "token_dtype": token_dtype,
        }
        cfg = Config(model=model.cfg)
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=seq_len, **data))
        totals = _sums(model, cfg, task="tokens", split="valid", batch_size=batch_size)
    nll = totals["nll_sum"] / max(totals["tokens"], 1.0)
    return {
        "perplexity": float(np.exp(nll)),
        "nll": nll,
        "tokens": int(totals["tokens"]),
        "seq_len": seq_len,
    }


def _sums(model: LanguageModel, cfg: Config, *, task: str, split: str, batch_size: int) -> dict:
    """training.eval_step's sums over every example of the split (host floats)."""
    data = dataclasses.replace(cfg.data, task=task, batch_size=batch_size or cfg.data.batch_size)
    cfg = dataclasses.replace(cfg, model=model.cfg, data=data)
    graphdef, state = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(state)
    totals = None
    for batch in pipeline.eval_batches(cfg, "", split):
        batch = {k: v for k, v in batch.items() if k != "seq_idx"}  # rows are plain windows
        sums = _eval_step(params, batch, graphdef=graphdef)
        totals = sums if totals is None else jax.tree.map(np.add, totals, sums)
    return {k: float(v) for k, v in totals.items()}


@functools.partial(jax.jit, static_argnames="graphdef")
def _eval_step(params, batch, *, graphdef):
    """training.eval_step, compiled once per model graph and batch shape."""
    return training.eval_step(params, batch, graphdef=graphdef)
