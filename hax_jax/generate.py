"""Sampling from a LanguageModel: a parallel prefill returning the caches, then a jitted decode
loop.

Rows of a batch may hold prompts of different lengths, padded on the left or on the right (`mask`
marks the real tokens). The prefill runs the parallel forward over the shortest prompt's length;
from there every row advances one position per step in lockstep, fed its own next prompt token
while it has one ("forced") and its sampled token after. So each row sees exactly its own tokens at
positions 0, 1, ..., as alone, for every mixer kind (no padding ever enters a cache), at the price
of stepping through the longer prompts' tails one token at a time. (The prefill length is rounded
down to a bucket, so that batches of similar lengths share one compiled prefill.)

`generate_reference` is the slow twin: the same loop, but every step re-runs the full parallel
forward over all tokens so far instead of using the caches.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hax_jax.layers.fused import decode_copies, use_decode_copies
from hax_jax.models.lm import LanguageModel


class Generation(NamedTuple):
    """What `generate` returns (numpy arrays)."""

    tokens: np.ndarray  # (b, max_new_tokens) int32; pad_id after a row's stop token
    lengths: np.ndarray  # (b,) int32 tokens generated per row, its stop token included
    logits: np.ndarray | None  # (b, max_new_tokens, vocab_size) fp32 with return_logits, else None


class Sampling(NamedTuple):
    """How the next token is drawn; temperature 0 = greedy (argmax, ties to the lowest id)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = all tokens
    top_p: float = 1.0  # nucleus: the fewest most likely tokens whose probability reaches top_p


def sample(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """logits (b, v) fp32 -> next tokens (b,) int32 under `sampling`."""
    if sampling.temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / sampling.temperature
    if sampling.top_k > 0:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampling.top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # Keep a token when the tokens before it hold less than top_p: the first is always kept.
        keep_sorted = jnp.cumsum(probs, axis=-1) - probs < sampling.top_p
        keep = (
            jnp.zeros_like(keep_sorted)
            .at[jnp.arange(logits.shape[0])[:, None], order]
            .set(keep_sorted)
        )
        logits = jnp.where(keep, logits, -jnp.inf)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


class _Loop(NamedTuple):
    """The decode loop's carry (all arrays; the caches ride beside it)."""

    t: jax.Array  # () int32: the position whose token is chosen next
    logits: jax.Array  # (b, v) fp32: the distribution of position t
    out: jax.Array  # (b, m) int32 generated tokens
    out_logits: jax.Array  # (b, m, v) fp32, or (b, 0, v) without return_logits
    count: jax.Array  # (b,) int32 tokens generated
    done: jax.Array  # (b,) bool: stopped or full


def _first_loop(t, logits, m: int, pad_id: int, return_logits: bool) -> _Loop:
    """The loop before its first token: position t's logits (b, v), nothing generated yet."""
    b, v = logits.shape
    return _Loop(
        t=t,
        logits=logits,
        out=jnp.full((b, m), pad_id, jnp.int32),
        out_logits=jnp.zeros((b, m if return_logits else 0, v)),
        count=jnp.zeros((b,), jnp.int32),
        done=jnp.zeros((b,), bool),
    )


def _choose(loop: _Loop, prompts, lengths, key, stop, sampling: Sampling):
    """Position t's token for every row (its prompt's or a sample) and the loop's bookkeeping."""
    b, m = loop.out.shape
    forced = loop.t < lengths
    sampled = sample(loop.logits, jax.random.fold_in(key, loop.t), sampling)
    prompt_t = prompts[:, jnp.minimum(loop.t, prompts.shape[1] - 1)]
    token = jnp.where(forced, prompt_t, sampled)
    fresh = ~forced & ~loop.done  # rows whose sample is a new output token
    rows = jnp.arange(b)
    slot = jnp.where(fresh, loop.count, m)  # index m is out of bounds: the write is dropped
    out = loop.out.at[rows, slot].set(sampled, mode="drop")
    out_logits = loop.out_logits
    if out_logits.shape[1]:
        out_logits = out_logits.at[rows, slot].set(loop.logits, mode="drop")
    count = loop.count + fresh
    stopped = fresh & jnp.isin(sampled, stop)
    done = loop.done | stopped | (count >= m)
    return token, loop._replace(out=out, out_logits=out_logits, count=count, done=done)


def _mask_vocab(logits: jax.Array, vocab_size: int) -> jax.Array:
    """The padded vocabulary's extra ids never come out."""
    return jnp.where(jnp.arange(logits.shape[-1]) < vocab_size, logits, -jnp.inf)


@functools.partial(jax.jit, static_argnames=("graphdef", "capacity"))
def _prefill(graphdef, state, prefix, *, capacity):
    """The parallel forward over the common prefix (b, p): (last logits (b, v), caches)."""
    model = nnx.merge(graphdef, state)
    logits, cache = model.forward(prefix, cache=model.init_cache(prefix.shape[0], capacity))
    return logits[:, -1], cache


@functools.partial(jax.jit, static_argnames="graphdef")
def _decode_copies(graphdef, state):
    """The kernels as the decode loop reads them (`decode_copies`), in a program of their own."""
    return decode_copies(nnx.merge(graphdef, state))


def _decode_loop(
    graphdef,
    state,
    copies,
    cache,
    logits,
    prompts,
    lengths,
    start,
    key,
    stop,
    *,
    sampling: Sampling,
    max_new_tokens: int,
    return_logits: bool,
    pad_id: int,
):
    """Steps from position `start` until every row has stopped or generated max_new_tokens."""
    model = nnx.merge(graphdef, state)
    use_decode_copies(model, copies)
    m = max_new_tokens
    vocab = model.cfg.vocab_size
    loop = _first_loop(start, _mask_vocab(logits, vocab), m, pad_id, return_logits)

    def body(carry):
        loop, cache = carry
        token, loop = _choose(loop, prompts, lengths, key, stop, sampling)
        logits, cache = model.step(token, cache)
        return loop._replace(t=loop.t + 1, logits=_mask_vocab(logits, vocab)), cache

    loop, _ = jax.lax.while_loop(lambda carry: ~jnp.all(carry[0].done), body, (loop, cache))
    return loop.out, loop.count, loop.out_logits


_DECODE_STATIC = ("graphdef", "sampling", "max_new_tokens", "return_logits", "pad_id")
_decode = jax.jit(_decode_loop, static_argnames=_DECODE_STATIC)
# On a GPU, XLA records the loop body's kernels into a CUDA graph as one serial chain by default;
# CONCURRENT orders them only by the buffers they share, so independent kernels run at once (the
# sparse branch's beside its mixer's: at batch 1 each uses a few SMs). One H200, batch 1: the whole
# generate call 22% shorter for HAX-Mamba-2 130M, 8% for Mamba-2 (BENCHMARKS.md, 33rd session).
CONCURRENT_CUDA_GRAPHS = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}
_decode_gpu = jax.jit(
    _decode_loop, static_argnames=_DECODE_STATIC, compiler_options=CONCURRENT_CUDA_GRAPHS
)


def _decode_program():
    """The jitted decode loop generate runs on this backend."""
    return _decode_gpu if jax.default_backend() == "gpu" else _decode


def generate(
    model: LanguageModel,
    tokens,
    max_new_tokens: int,
    *,
    mask=None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_tokens=(),
    pad_id: int = 0,
    return_logits: bool = False,
) -> Generation:
    """Continues each row of `tokens` by up to max_new_tokens sampled tokens, decoding from caches.

    Args:
      model: the LanguageModel (any mixer kinds).
      tokens: (b, l) int prompts; with `mask`, padded on either side.
      max_new_tokens: tokens to generate per row (a row stops early at a stop token).
      mask: (b, l) bool, True at real tokens, one contiguous run per row; None = all real.
      temperature, top_k, top_p: sampling (temperature 0 = greedy).
      seed: the sampling key; the same seed gives the same tokens.
      stop_tokens: ids that end a row (the stop token is kept in the output); None = none.
      pad_id: fills each row's output after it stops.
      return_logits: also return the fp32 logits each generated token was drawn from.

    Returns:
      Generation(tokens (b, max_new_tokens), lengths (b,), logits or None).
    """
    prompts, lengths = _pack_prompts(model, tokens, mask, max_new_tokens)
    sampling = _sampling(temperature, top_k, top_p)
    start = _prefill_length(int(lengths.min()))
    width = -(-prompts.shape[1] // 64) * 64  # fewer distinct shapes, fewer compiles
    prompts = np.pad(prompts, ((0, 0), (0, width - prompts.shape[1])))
    graphdef, state = nnx.split(model)
    capacity = width + max_new_tokens
    last, cache = _prefill(graphdef, state, jnp.asarray(prompts[:, :start]), capacity=capacity)
    out, count, out_logits = _decode_program()(
        graphdef,
        state,
        _decode_copies(graphdef, state),
        cache,
        last,
        jnp.asarray(prompts),
        jnp.asarray(lengths),
        jnp.asarray(start, jnp.int32),
        jax.random.key(seed),
        _stop_ids(stop_tokens),
        sampling=sampling,
        max_new_tokens=max_new_tokens,
        return_logits=return_logits,
        pad_id=pad_id,
    )
    return _result(model, out, count, out_logits, return_logits)


def generate_reference(
    model: LanguageModel,
    tokens,
    max_new_tokens: int,
    *,
    mask=None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_tokens=(),
    pad_id: int = 0,
    return_logits: bool = False,
) -> Generation:
    """`generate` without caches, the slow twin: each step re-runs the full parallel forward.

    The tokens so far sit in a (b, P + max_new_tokens) buffer, zeros after them; position t's logits
    are read from the forward of the whole buffer, so causality keeps the zeros out (one compile).
    """
    prompts, lengths = _pack_prompts(model, tokens, mask, max_new_tokens)
    sampling = _sampling(temperature, top_k, top_p)
    b, m = prompts.shape[0], max_new_tokens
    key, stop = jax.random.key(seed), _stop_ids(stop_tokens)
    graphdef, state = nnx.split(model)
    start = int(lengths.min())
    seq = jnp.zeros((b, prompts.shape[1] + m), jnp.int32).at[:, :start].set(prompts[:, :start])
    logits = _logits_at(graphdef, state, seq, start - 1)
    loop = _first_loop(jnp.asarray(start, jnp.int32), logits, m, pad_id, return_logits)
    prompts_j, lengths_j = jnp.asarray(prompts), jnp.asarray(lengths)
    while not bool(jnp.all(loop.done)):
        token, loop = _choose(loop, prompts_j, lengths_j, key, stop, sampling)
        seq = seq.at[:, loop.t].set(token)
        loop = loop._replace(t=loop.t + 1, logits=_logits_at(graphdef, state, seq, loop.t))
    return _result(model, loop.out, loop.count, loop.out_logits, return_logits)


@functools.partial(jax.jit, static_argnames="graphdef")
def _logits_at(graphdef, state, seq, t):
    """The full forward over seq (b, l); the (vocab-masked) logits at position t (b, v)."""
    model = nnx.merge(graphdef, state)
    return _mask_vocab(model(seq)[:, t], model.cfg.vocab_size)


def _prefill_length(shortest: int) -> int:
    """The prefill covers the shortest prompt rounded down to a bucket (the rest is fed step by
    step), so batches of similar lengths share one compiled prefill."""
    if shortest >= 512:
        return shortest // 256 * 256
    return shortest // 64 * 64 if shortest >= 64 else shortest


def _result(model, out, count, out_logits, return_logits: bool) -> Generation:
    """Host arrays; the logits cut to the real vocabulary."""
    logits = np.asarray(out_logits)[..., : model.cfg.vocab_size] if return_logits else None
    return Generation(np.asarray(out), np.asarray(count), logits)


def _is_int(value) -> bool:
    """An int or numpy integer, not a bool (True would silently mean 1)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_real(value) -> bool:
    """A Python or numpy real number, not a bool."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _sampling(temperature: float, top_k: int, top_p: float) -> Sampling:
    """Checked sampling settings."""
    if not _is_real(temperature) or not temperature >= 0:  # `not >=` also refuses NaN
        raise ValueError(f"temperature={temperature!r} must be a number >= 0")
    if not _is_int(top_k) or top_k < 0:
        raise ValueError(f"top_k={top_k!r} must be an int >= 0 (0 = no limit)")
    if not _is_real(top_p) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p!r} must be a number in (0, 1]")
    return Sampling(float(temperature), int(top_k), float(top_p))


def _stop_ids(stop_tokens) -> jax.Array:
    """The stop ids as a flat int32 array; None and () mean none."""
    ids = np.asarray(() if stop_tokens is None else stop_tokens)
    if ids.size and ids.dtype.kind not in "iu":
        raise ValueError(f"stop_tokens must be int ids, got {stop_tokens!r}")
    return jnp.asarray(ids, jnp.int32).reshape(-1)


def _pack_prompts(model: LanguageModel, tokens, mask, max_new_tokens: int):
    """Each row's real tokens moved to the front: (prompts (b, P) int32, lengths (b,) int32)."""
    # max_new_tokens sizes the output and the caches: a float would fail deep inside jit.
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive int")
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or tokens.dtype.kind not in "iu":
        raise ValueError(f"tokens must be integer (b, l), got {tokens.dtype} {tokens.shape}")
    if tokens.shape[0] == 0:
        raise ValueError(f"tokens must hold at least one prompt, got batch size 0 {tokens.shape}")
    mask = np.ones(tokens.shape, bool) if mask is None else np.asarray(mask, bool)
    if mask.shape != tokens.shape:
        raise ValueError(f"mask shape {mask.shape} differs from tokens shape {tokens.shape}")
    lengths = mask.sum(axis=1).astype(np.int32)
    prompts = np.zeros((tokens.shape[0], max(int(lengths.max(initial=0)), 1)), np.int32)
    for i, (row, real) in enumerate(zip(tokens, mask, strict=True)):
        where = np.flatnonzero(real)
        if where.size == 0:
            raise ValueError(f"row {i} has no real token (mask is all False)")
        if where[-1] - where[0] + 1 != where.size:
            raise ValueError(f"row {i}'s mask is not one contiguous run (left or right padding)")
        prompts[i, : where.size] = row[where]
    bad = (prompts < 0) | (prompts >= model.cfg.vocab_size)
    if np.any(bad & (np.arange(prompts.shape[1]) < lengths[:, None])):
        value = prompts[bad & (np.arange(prompts.shape[1]) < lengths[:, None])][0]
        raise ValueError(f"token id {value} is out of range [0, vocab_size={model.cfg.vocab_size})")
    return prompts, lengths
