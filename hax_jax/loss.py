"""Per-token cross-entropy and argmax from the final hidden states, whole or a chunk at a time.

At 1 x 1M tokens and a 50288 vocab the fp32 logits alone are 211 GB. `token_nll_chunked` computes
them for a chunk of positions at a time in a scan under `jax.checkpoint`, so the forward holds one
chunk's logits and the backward recomputes them chunk by chunk; `token_nll` is its whole-row twin.
"""

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from hax_jax.config import LOGITS_BUDGET
from hax_jax.sharding import current_mesh, logical_to_spec, shard


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
    b, l, d = h.shape
    m = -(-l // n_chunks)  # positions per row in a chunk
    pad = n_chunks * m - l  # padded positions give finite losses that are cut off below
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
    labels = jnp.pad(labels, ((0, 0), (0, pad)))
    # Chunk j holds positions i * n_chunks + j (i < m). Position i stays the major axis, so a
    # sequence split over "seq" stays split (each device scans its own positions); contiguous chunks
    # would each live on one device and GSPMD would gather the rows.
    h_cbmd = shard(jnp.moveaxis(h.reshape(b, m, n_chunks, d), 2, 0), None, "batch", "seq", "embed")
    labels_cbm = jnp.moveaxis(labels.reshape(b, m, n_chunks), 2, 0)

    # Under checkpoint the scan saves only each chunk's inputs; the backward recomputes the chunk's
    # logits rather than keeping all of them (prevent_cse is not needed inside a scan).
    @functools.partial(jax.checkpoint, prevent_cse=False)
    def one_chunk(args):
        """One chunk's (cross-entropy, argmax), both (b, m)."""
        h_bmd, labels_bm = args
        logits = head(shard(h_bmd, "batch", "seq", "embed"))
        return token_nll(shard(logits, "batch", "seq", "vocab"), labels_bm)

    nll_cbm, pred_cbm = jax.lax.map(one_chunk, (h_cbmd, labels_cbm))

    def unchunk(x_cbm: jax.Array) -> jax.Array:
        """(c, b, m) per chunk -> (b, l) per position."""
        return jnp.moveaxis(x_cbm, 0, 2).reshape(b, n_chunks * m)[:, :l]

    return unchunk(nll_cbm), unchunk(pred_cbm)
