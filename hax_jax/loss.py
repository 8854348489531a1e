"""Per-token cross-entropy and argmax from the final hidden states, whole or a chunk at a time.

At 1 x 1M tokens and a 50288 vocab the fp32 logits alone are 211 GB. `token_nll_chunked` computes
them for a chunk of positions at a time in a scan under `jax.checkpoint`, so the forward holds one
chunk's logits and the backward recomputes them chunk by chunk; `token_nll` is its whole-row twin.
Training's loss takes `weighted_nll` instead: the same chunks, with the head's gradients taken in
the forward, so the backward neither keeps nor recomputes any logits.
"""

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from hax_jax.config import LOGITS_BUDGET
from hax_jax.sharding import current_mesh, logical_to_spec, shard, split_axes


def token_nll(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    """logits (b, l, v) fp32, labels (b, l) -> (cross-entropy (b, l) fp32, argmax (b, l) int).

    Over all padded_vocab_size columns: the padding rows of the embedding take part, as they
    always have (their logits are those of untrained rows, never labels).
    """
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return nll, jnp.argmax(logits, -1)


def chunk_count(shape_blv: tuple[int, int, int], loss_chunk: int) -> int:
    """Chunks of positions per row for logits of `shape_blv` (b, l, v) (1 = whole rows).

    `loss_chunk` > 0 caps the positions per row in a chunk; 0 (auto) takes the fewest power-of-two
    chunks whose fp32 logits fit in LOGITS_BUDGET on one device, counted over a row's positions
    whether or not "seq" splits them: a split sequence keeps one device's chunks, each spread over
    the shards, so its logits shrink with the shards as its activations do. Powers of two keep a
    power-of-two row divisible, so the chunks need no padding.
    """
    b, l, v = shape_blv
    if loss_chunk:
        return -(-l // loss_chunk)
    mesh = current_mesh()
    split = 1
    if mesh is not None:
        batch, _, vocab = logical_to_spec(("batch", "seq", "vocab"), shape_blv, mesh)
        split = math.prod(mesh.shape[axis] for axis in (batch, vocab) if axis is not None)
    per_device = 4 * b * l * v // split
    n = 1
    while per_device > n * LOGITS_BUDGET and n < l:
        n *= 2
    return min(n, l)


def token_nll_chunked(
    h: jax.Array,
    labels: jax.Array,
    head: Callable[[jax.Array], jax.Array],
    n_chunks: int,
) -> tuple[jax.Array, jax.Array]:
    """`token_nll(head(h), labels)` computed `n_chunks` chunks of positions at a time.

    Under a mesh that splits l over "seq", a count that divides l into chunks of positions divisible
    by the "seq" size keeps every device on its own positions (auto's powers of two do for the usual
    powers-of-two rows); otherwise the padding makes GSPMD gather the rows first (same numbers).

    Args:
      h: (b, l, d) final hidden states (LanguageModel.hidden).
      labels: (b, l) int targets.
      head: (b, m, d) -> (b, m, v) fp32 logits (LanguageModel.head).
      n_chunks: chunks per row (chunk_count); 1 computes the whole (b, l, v) logits at once.

    Returns:
      (cross-entropy (b, l) fp32, argmax (b, l) int), as token_nll gives them.
    """
    if n_chunks == 1:
        return token_nll(shard(head(h), "batch", "seq", "vocab"), labels)
    h_cbmd, (labels_cbm,) = _to_chunks(h, (labels,), n_chunks)

    # Under checkpoint the scan saves only each chunk's inputs; the backward recomputes the chunk's
    # logits rather than keeping all of them (prevent_cse is not needed inside a scan).
    @functools.partial(jax.checkpoint, prevent_cse=False)
    def one_chunk(args):
        """One chunk's (cross-entropy, argmax), both (b, m)."""
        h_bmd, labels_bm = args
        logits = head(shard(h_bmd, "batch", "seq", "embed"))
        return token_nll(shard(logits, "batch", "seq", "vocab"), labels_bm)

    nll_cbm, pred_cbm = jax.lax.map(one_chunk, (h_cbmd, labels_cbm))
    l = h.shape[1]
    return _from_chunks(nll_cbm, l), _from_chunks(pred_cbm, l)


def _to_chunks(h: jax.Array, per_position: tuple[jax.Array, ...], n_chunks: int):
    """h (b, l, d) -> (c, b, m, d) and each (b, l) array -> (c, b, m): chunk j holds positions
    i * n_chunks + j (i < m), the rows padded to n_chunks * m positions (padded positions give
    finite losses that are cut off or weighed 0). Position i stays the major axis, so a sequence
    split over "seq" stays split (each device scans its own positions); contiguous chunks would
    each live on one device and GSPMD would gather the rows."""
    b, l, d = h.shape
    m = -(-l // n_chunks)  # positions per row in a chunk
    pad = n_chunks * m - l
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
    h_cbmd = shard(jnp.moveaxis(h.reshape(b, m, n_chunks, d), 2, 0), None, "batch", "seq", "embed")
    chunked = tuple(
        jnp.moveaxis(jnp.pad(x, ((0, 0), (0, pad))).reshape(b, m, n_chunks), 2, 0)
        for x in per_position
    )
    return h_cbmd, chunked


def _from_chunks(x_cbm: jax.Array, l: int) -> jax.Array:
    """(c, b, m, ...) per chunk -> (b, l, ...) per position (`_to_chunks`' inverse)."""
    c, b, m = x_cbm.shape[:3]
    return jnp.moveaxis(x_cbm, 0, 2).reshape(b, c * m, *x_cbm.shape[3:])[:, :l]


def weighted_nll(
    h: jax.Array,
    labels: jax.Array,
    weights: jax.Array,
    head: Callable,
    head_params,
    n_chunks: int,
) -> tuple[jax.Array, jax.Array]:
    """(sum over positions of weights x cross-entropy, argmax (b, l)) of the logits
    `head(head_params, h)`, `n_chunks` chunks of positions at a time (as `token_nll_chunked`),
    differentiable in h and head_params (weights and labels carry no gradient).

    The cross-entropy's gradient in its logits is known as soon as they are: weights x (softmax -
    one-hot). So each chunk's forward goes on through the head's VJP at once and keeps only the
    gradients, (b, l, d) for h and one sum for the head's parameters, which the backward scales by
    the loss's cotangent: no logits are kept for the backward (as autodiff of whole rows keeps
    them) nor recomputed in it (as `token_nll_chunked`'s checkpointed chunks are). The same
    matmuls as autodiff's, in the forward. Where a mesh splits the rows or positions, each device
    adds up its own part of the head's gradient over the chunks and the parts are summed over the
    devices once, after the chunks, in h's dtype (GSPMD would sum each chunk's inside the loop:
    at 1M tokens on seq=2, 64 sums of the whole table a step instead of one).

    Args:
      h: (b, l, d) final hidden states (LanguageModel.hidden).
      labels: (b, l) int targets.
      weights: (b, l) each position's weight in the sum (e.g. loss_mask / its count).
      head: (head_params, (b, m, d)) -> (b, m, v) fp32 logits (LanguageModel.head_function).
      head_params: the head's parameters (a pytree of arrays).
      n_chunks: chunks per row (chunk_count).
    """
    return _weighted_nll(head, n_chunks, h, labels, weights, head_params)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _weighted_nll(head, n_chunks, h, labels, weights, head_params):
    return _weighted_nll_fwd(head, n_chunks, h, labels, weights, head_params)[0]


def _weighted_nll_fwd(head, n_chunks, h, labels, weights, head_params):
    l = h.shape[1]
    h_cbmd, (labels_cbm, weights_cbm) = _to_chunks(h, (labels, weights), n_chunks)
    # One chunk: GSPMD's sum of its gradient inside the loop runs once anyway.
    split = _device_split(h_cbmd.shape[1:]) if n_chunks > 1 else None

    def one_chunk(d_params, args):
        """Adds the chunk's head-parameter gradient; (weighted sum, argmax, h's gradient)."""
        h_bmd, labels_bm, weights_bm = args
        logits, pull = jax.vjp(
            lambda p, x: head(p, shard(x, "batch", "seq", "embed")), head_params, h_bmd
        )
        logits = shard(logits, "batch", "seq", "vocab")
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, labels_bm)
        one_hot = jax.nn.one_hot(labels_bm, logits.shape[-1], dtype=logits.dtype)
        d_logits = weights_bm[..., None] * (jax.nn.softmax(logits) - one_hot)
        d_params_chunk, d_h = pull(d_logits)
        if split is not None:  # pull's (summed over the devices) is then unused
            d_params_chunk = _per_device_grads(head, head_params, h_bmd, d_logits, split)
        d_params = jax.tree.map(jnp.add, d_params, d_params_chunk)
        return d_params, (jnp.sum(weights_bm * nll), jnp.argmax(logits, -1), d_h)

    if split is None:
        zeros = jax.tree.map(jnp.zeros_like, head_params)
    else:  # one sum a device
        devices = split[1] * split[2]
        zeros = jax.tree.map(
            lambda p: _stacked(jnp.zeros((devices, *p.shape), p.dtype), split[0]), head_params
        )
    d_params, (sums, pred_cbm, d_h_cbmd) = jax.lax.scan(
        one_chunk, zeros, (h_cbmd, labels_cbm, weights_cbm)
    )
    if split is not None:
        # One sum over the devices, after the chunks and in the compute dtype (h's), as each
        # device's matmul made its part; GSPMD summed each chunk's inside the scan before.
        d_params = jax.tree.map(
            lambda d, p: _sum_over_devices(d, h.dtype).astype(p.dtype), d_params, head_params
        )
    outputs = (jnp.sum(sums), _from_chunks(pred_cbm, l))
    return outputs, (_from_chunks(d_h_cbmd, l), d_params)


def _weighted_nll_bwd(head, n_chunks, residuals, cotangents):
    d_h, d_params = residuals
    g = cotangents[0]  # the argmax's (integer) cotangent is empty
    scale = lambda x: (g * x).astype(x.dtype)  # noqa: E731
    return scale(d_h), None, None, jax.tree.map(scale, d_params)


_weighted_nll.defvjp(_weighted_nll_fwd, _weighted_nll_bwd)


def _device_split(shape_bmd) -> tuple[tuple[str, ...], int, int] | None:
    """(the mesh axes that split a chunk's rows and positions, rows' shards, positions'
    shards) where the mesh splits either (as `shard` lays h out), else None."""
    mesh = current_mesh()
    if mesh is None:
        return None
    batch, seq, _ = logical_to_spec(("batch", "seq", "embed"), shape_bmd, mesh)
    sizes = dict(mesh.shape)
    rows, positions = split_axes(batch, sizes), split_axes(seq, sizes)
    if not rows + positions:
        return None
    count = lambda axes: math.prod(sizes[a] for a in axes)  # noqa: E731
    return rows + positions, count(rows), count(positions)


def _per_device_grads(head, head_params, h_bmd, d_logits, split) -> dict:
    """The head's parameter gradient from each device's own rows and positions of a chunk,
    stacked (devices, *shape) with device g's at index g: nothing is summed across devices, so
    the scan can add the chunks up on each device and sum over the devices once after it."""
    axes, rows, positions = split
    mesh = current_mesh()

    def by_device(x, name):
        """(b, m, w) -> (devices, b / rows, m / positions, w): each device's block in place."""
        b, m = x.shape[:2]
        tail = logical_to_spec(("batch", "seq", name), x.shape, mesh)[2]
        x = x.reshape(rows, b // rows, positions, m // positions, x.shape[2]).swapaxes(1, 2)
        x = x.reshape(rows * positions, b // rows, m // positions, x.shape[-1])
        return jax.lax.with_sharding_constraint(x, PartitionSpec(axes, None, None, tail))

    def one(h_g, d_logits_g):
        return jax.vjp(lambda p: head(p, h_g), head_params)[1](d_logits_g)[0]

    grads = jax.vmap(one)(by_device(h_bmd, "embed"), by_device(d_logits, "vocab"))
    return jax.tree.map(lambda g: _stacked(g, axes), grads)


def _sum_over_devices(x: jax.Array, dtype) -> jax.Array:
    """x (devices, ...) summed over its first axis in `dtype` (jnp.sum would widen bf16 to fp32
    for the sum, and the devices would exchange fp32)."""
    x = x.astype(dtype)
    return jax.lax.reduce(x, jnp.zeros((), dtype), jax.lax.add, (0,))


def _stacked(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """x (devices, ...) with its first axis split over the mesh `axes` (the rest as GSPMD
    chooses)."""
    rest = (PartitionSpec.UNCONSTRAINED,) * (x.ndim - 1)
    return jax.lax.with_sharding_constraint(x, PartitionSpec(axes, *rest))
