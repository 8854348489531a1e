"""A model with its tokenizer, as the text tasks use it: completions and log-likelihoods.

`complete` generates through `hax_jax.generate` (the caches); `loglikelihoods` scores continuations
with one parallel forward per batch. Both sort requests by length and batch them, padding on the
right (causal, so padding never reaches a real position) to widths rounded up to 64 tokens, and fill
a short last batch with copies, so that few shapes are compiled.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hax_jax.data import text
from hax_jax.generate import generate
from hax_jax.models.lm import LanguageModel

WIDTH_BUCKET = 64


def complete(
    model: LanguageModel,
    tokenizer,
    prompts: list[str],
    max_new_tokens: int,
    *,
    batch_size: int = 8,
    until: tuple[str, ...] = (),
    max_prompt_tokens: int = 0,
    **sampling,
) -> list[str]:
    """Greedy continuations of `prompts` (a row stops at the end-of-text token).

    Prompts are sorted by length and batched so that rows of a batch have similar lengths (fewer
    tokens fed one by one); a prompt longer than max_prompt_tokens (> 0) keeps its last tokens; the
    text is cut at the first of the `until` strings. `sampling`: generate's temperature, top_k,
    top_p, seed (greedy by default).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    eos = text.eos_id(tokenizer)
    encoded = [tokenizer.encode(p, add_special_tokens=False).ids or [eos] for p in prompts]
    if max_prompt_tokens > 0:
        encoded = [ids[-max_prompt_tokens:] for ids in encoded]
    out = [""] * len(prompts)
    for rows in _batches(encoded, batch_size):
        tokens, mask = _right_padded([encoded[i] for i in rows])
        result = generate(model, tokens, max_new_tokens, mask=mask, stop_tokens=[eos], **sampling)
        for r, i in enumerate(rows):
            ids = result.tokens[r, : result.lengths[r]].tolist()
            out[i] = _cut(tokenizer.decode([t for t in ids if t != eos]), until)
    return out


def loglikelihoods(
    model: LanguageModel, requests: list[tuple[list[int], list[int]]], *, batch_size: int = 8
) -> list[tuple[float, bool]]:
    """For each (context ids, continuation ids): (log p(continuation | context), whether every
    continuation token is the argmax). Inputs longer than the model takes are the caller's to
    cut."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    for i, (context, continuation) in enumerate(requests):
        if not context or not continuation:
            raise ValueError(f"request {i} needs a non-empty context and continuation")
    sequences = [context + continuation for context, continuation in requests]
    graphdef, state = nnx.split(model)
    out: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
    for rows in _batches(sequences, batch_size):
        tokens, mask = _right_padded([sequences[i][:-1] for i in rows])
        targets, _ = _right_padded([sequences[i][1:] for i in rows], width=tokens.shape[1])
        logprobs, greedy = _token_logprobs(graphdef, state, tokens, targets)
        for r, i in enumerate(rows):
            n_in, n_cont = len(sequences[i]) - 1, len(requests[i][1])
            span = slice(n_in - n_cont, n_in)
            out[i] = (float(np.sum(logprobs[r, span])), bool(np.all(greedy[r, span])))
    return out


@functools.partial(jax.jit, static_argnames="graphdef")
def _token_logprobs(graphdef, state, tokens, targets):
    """log p(target) and whether it is the argmax, at every position (b, l)."""
    model = nnx.merge(graphdef, state)
    logits = model(tokens)[..., : model.cfg.vocab_size]
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0]
    return picked, jnp.argmax(logits, axis=-1) == targets


def _batches(sequences: list[list[int]], batch_size: int):
    """Index lists of `batch_size` (longest first; a short last batch is filled with copies)."""
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
    for first in range(0, len(order), batch_size):
        rows = order[first : first + batch_size]
        yield rows + rows[-1:] * (batch_size - len(rows))


def _right_padded(rows: list[list[int]], width: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, mask) (b, width): rows on the left, zeros after; width rounded up to the bucket."""
    width = width or -(-max(len(r) for r in rows) // WIDTH_BUCKET) * WIDTH_BUCKET
    tokens = np.zeros((len(rows), width), np.int32)
    mask = np.zeros((len(rows), width), bool)
    for r, ids in enumerate(rows):
        tokens[r, : len(ids)] = ids
        mask[r, : len(ids)] = True
    return tokens, mask


def _cut(completion: str, until: tuple[str, ...]) -> str:
    """The completion up to the first of the stop strings."""
    for stop in until:
        if stop and stop in completion:
            completion = completion[: completion.index(stop)]
    return completion
