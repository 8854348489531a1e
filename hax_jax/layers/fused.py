"""Projections and convs that checkpoints store fused, kept part by part so each part shards alone.

mamba_ssm's Mamba-2 in_proj is one Linear whose output is [z | x | B | C | dt], its conv1d one
depthwise conv over [x | B | C] (Mamba-1: in_proj -> [x | z]). Split over "tensor" as one axis, a
device would hold a piece of z and a piece of x, and slicing the parts out would reshard them
(collective-permutes and all-to-alls in every block). Stored as one parameter per part, each part
splits on its own logical axes: a device's z, x, dt for its heads and B, C for its groups are local
(Mamba-2 paper §8.1). The fused layout lives on only in `parts`, which conversion
(hax_jax.convert) reads to slice and concatenate checkpoints' tensors.

Initialisation draws the fused tensor with one key, as one nnx.Linear / CausalConv1d would, and
cuts it into parts: the same values as the fused layer for the same rngs.
"""

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from hax_jax.layers.conv import conv_shard
from hax_jax.layers.init import torch_linear_init
from hax_jax.layers.linear import Linear, rows_first, rows_matmul
from hax_jax.parallel import per_device


class Part(NamedTuple):
    """One part of a fused output: its shape (flattened in the fused layout) and logical axes."""

    name: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def _cut(fused: jax.Array, parts: Sequence[Part], lead_axes, **meta):
    """An nnx.Dict of Params, one per part, cut from the last axis of `fused` and reshaped."""
    pieces = unfuse(fused, parts)
    return nnx.Dict(
        {
            p.name: nnx.Param(pieces[p.name], logical_axes=(*lead_axes, *p.axes), **meta)
            for p in parts
        }
    )


def fuse(arrays: Mapping[str, jax.Array], parts: Sequence[Part], lead: int) -> jax.Array:
    """The fused array: each part flattened after its first `lead` axes, concatenated in order."""
    return side_by_side(arrays, [p.name for p in parts], lead)[0]


def unfuse(fused: jax.Array, parts: Sequence[Part]) -> dict[str, jax.Array]:
    """Inverse of `fuse`: the parts of the last axis, each in its own shape."""
    return apart(fused, [p.name for p in parts], [p.shape for p in parts])


def part_arrays(layer) -> tuple[dict[str, jax.Array], dict[str, jax.Array] | None]:
    """A fused layer's kernels and biases (None without bias), as dicts of arrays."""
    kernels = {p.name: layer.kernel[p.name][...] for p in layer.parts}
    if layer.bias is None:
        return kernels, None
    return kernels, {p.name: layer.bias[p.name][...] for p in layer.parts}


class FusedLinear(nnx.Module):
    """x (..., in) -> {part: (..., *part.shape)}: one Linear's output, stored part by part."""

    def __init__(
        self,
        in_features: int,
        parts: Sequence[Part],
        *,
        in_axis: str | None,
        use_bias: bool,
        dtype,
        rngs: nnx.Rngs,
        kernel_init=None,
    ):
        self.parts = tuple(parts)
        total = sum(p.size for p in parts)
        init = kernel_init or torch_linear_init(in_features)
        kernel = init(rngs.params(), (in_features, total))
        self.kernel = _cut(kernel, parts, (in_axis,))
        self.bias = nnx.data(None)
        if use_bias:
            rngs.params()  # nnx.Linear draws a key for its (zero) bias: keep the same key stream
            self.bias = _cut(jnp.zeros((total,), jnp.float32), parts, ())
        self.dtype = dtype
        self.decoding = nnx.data(None)  # `decode_copy()` once generate gave it one

    def arrays(self) -> tuple[dict[str, jax.Array], dict[str, jax.Array] | None]:
        """The parts' kernels and biases (None without bias), as dicts of arrays."""
        return part_arrays(self)

    def decode_copy(self) -> tuple[jax.Array, jax.Array | None]:
        """(the parts' kernels joined (in, total) and stored rows first (total, in), the biases
        joined), in `dtype`: what the decode loop reads (hax_jax.layers.linear says why). Joined at
        each call instead, the join stayed inside the decode loop on a GPU: 2.19 of the 5.23 ms of
        a Mamba-2 2.7B token on an H200 (one matmul a part instead was 4.2x slower there)."""
        order = [p.name for p in self.parts]
        kernel, bias, _ = joined_kernel(*self.arrays(), self.dtype, order)
        return rows_first(kernel), bias

    def __call__(self, x: jax.Array) -> dict[str, jax.Array]:
        order = [p.name for p in self.parts]
        if self.decoding is None:
            return linear_parts(x, *self.arrays(), self.dtype, order)
        y = rows_matmul(x.astype(self.dtype), *self.decoding)
        return apart(y, order, [p.shape for p in self.parts])


def _decoding_layers(model: nnx.Module):
    """(path in `model`, module) of every Linear and FusedLinear: the layers with a decode copy."""
    for path, node in nnx.iter_graph(model):
        if isinstance(node, Linear | FusedLinear):
            yield "/".join(map(str, path)), node


def decode_copies(model: nnx.Module) -> dict[str, tuple]:
    """Every Linear's and FusedLinear's `decode_copy`, by the module's path in `model`."""
    return {path: node.decode_copy() for path, node in _decoding_layers(model)}


def use_decode_copies(model: nnx.Module, copies: dict[str, tuple]) -> None:
    """Gives each Linear and FusedLinear of `model` its copy from `decode_copies`."""
    for path, node in _decoding_layers(model):
        node.decoding = nnx.data(copies[path])


def side_by_side(arrays: Mapping, order: Sequence[str], lead: int):
    """The arrays flattened after their first `lead` axes and concatenated in `order`, and the
    parts' own shapes of those trailing axes (for `apart`)."""
    shapes = [arrays[n].shape[lead:] for n in order]
    flat = [arrays[n].reshape(*arrays[n].shape[:lead], -1) for n in order]
    return jnp.concatenate(flat, axis=-1), shapes


def apart(joined: jax.Array, order: Sequence[str], shapes) -> dict[str, jax.Array]:
    """Inverse of `side_by_side`: {part: (..., *shape)} from the last axis of `joined` (slices, so
    a numpy array stays one)."""
    out, start = {}, 0
    for name, shape in zip(order, shapes, strict=True):
        size = math.prod(shape)
        out[name] = joined[..., start : start + size].reshape(*joined.shape[:-1], *shape)
        start += size
    return out


def joined_kernel(kernels: Mapping, biases: Mapping | None, dtype, order):
    """(the kernels (in, *shape) joined in `order` as (in, total), the biases as (total,) or None,
    both in `dtype` (None: as they are); the parts' shapes)."""
    # Each part cast before the join (the same values): a part is then read only cast, so it is
    # gathered cast under mesh.param_gather="use" (hax_jax/gather.py).
    kernel, shapes = side_by_side(cast_parts(kernels, dtype), order, lead=1)
    bias = None if biases is None else side_by_side(cast_parts(biases, dtype), order, lead=0)[0]
    return kernel, bias, shapes


JOINED = "joined"  # the one key of `for_shard_map`'s kernels when it joins the parts


class ShardMapKernels(NamedTuple):
    """A fused layer's kernels for a shard_map that projects with them (`for_shard_map`)."""

    kernels: dict
    biases: dict | None
    kernel_axes: dict
    bias_axes: dict
    order: list[str]


def for_shard_map(layer, dtype, axes: Mapping, *, join: bool) -> ShardMapKernels:
    """A FusedLinear's or FusedConv1d's kernels (and biases) for a shard_map that computes with
    them (fused_linear, conv_joined with `order`), with the logical axes of their channels `axes`
    {part: axes}. Each part is cast to `dtype` here (None: kept as it is), so the shard_map's
    backward sums their gradients over the devices that hold them whole ("data", "seq") in
    `dtype`. With `join` (no part split on the mesh) the parts are joined here too, along their
    channels: that sum is then one contiguous array a layer, where a sum a part is copied by XLA
    into one buffer with the others and sliced back out (and the joined kernel's gradient sliced
    into the parts before it)."""
    kernels, biases = (cast_parts(a, dtype) for a in layer.arrays())
    order = [p.name for p in layer.parts]
    if not join:
        kernel_axes = {k: (None, *axes[k]) for k in order}
        return ShardMapKernels(kernels, biases, kernel_axes, dict(axes), order)
    kernel, bias, _ = joined_kernel(kernels, biases, dtype, order)
    return ShardMapKernels(
        {JOINED: kernel},
        None if bias is None else {JOINED: bias},
        {JOINED: (None, None)},
        {JOINED: (None,)},
        [JOINED],
    )


def cast_parts(parts: Mapping | None, dtype) -> dict | None:
    """{part: array in dtype} (None stays None; dtype None keeps the arrays). Cast before a
    shard_map that reads them, the parts' gradients leave it in `dtype` too, so the sum over the
    devices that held the same part (data, seq) moves `dtype`'s bytes, as GSPMD's own sum of a
    replicated matmul's kernel does."""
    if parts is None or dtype is None:
        return None if parts is None else dict(parts)
    return {k: jnp.asarray(v).astype(dtype) for k, v in parts.items()}


def fused_linear(x: jax.Array, kernels: Mapping, biases: Mapping | None, dtype, order):
    """x (..., in) -> (the parts' outputs side by side (..., total), their shapes): the kernels
    (in, *shape) joined in `order`, one matmul, as the fused layer's (one GEMM per part made a
    Mamba-2 training step 14% slower on an H100). nnx.Linear's arithmetic: inputs and parameters
    in `dtype`."""
    kernel, bias, shapes = joined_kernel(kernels, biases, dtype, order)
    y = jnp.tensordot(x.astype(dtype), kernel, axes=1)
    return (y if bias is None else y + bias), shapes


def linear_parts(x, kernels: Mapping, biases: Mapping | None, dtype, order) -> dict:
    """x (..., in) -> {part: (..., *shape)}: `fused_linear`, taken apart."""
    y, shapes = fused_linear(x, kernels, biases, dtype, order)
    return apart(y, order, shapes)


class FusedConv1d(nnx.Module):
    """Depthwise causal conv over the channels of several parts, stored part by part.

    Its state (the decode cache) keeps the fused layout (b, width - 1, total channels), as
    mamba_ssm's conv_state does; under a split "seq" the parts share one halo exchange.
    """

    def __init__(
        self,
        parts: Sequence[Part],
        width: int,
        *,
        use_bias: bool,
        impl: str = "auto",
        rngs: nnx.Rngs,
    ):
        self.parts, self.width = tuple(parts), width
        self.impl = impl  # as layers/conv.py `causal_conv1d`'s
        total = sum(p.size for p in parts)
        init = torch_linear_init(width)  # torch Conv1d with groups=channels: fan_in = width
        self.kernel = _cut(init(rngs.params(), (width, total)), parts, (None,))
        self.bias = _cut(init(rngs.params(), (total,)), parts, ()) if use_bias else nnx.data(None)

    def init_state(self, batch: int, dtype) -> jax.Array:
        """The zero window (b, width - 1, total channels)."""
        return jnp.zeros((batch, self.width - 1, sum(p.size for p in self.parts)), dtype)

    def __call__(
        self,
        xs: Mapping[str, jax.Array],
        *,
        state: jax.Array | None = None,
        seq_idx: jax.Array | None = None,
    ) -> tuple[dict[str, jax.Array], jax.Array]:
        """xs {part: (b, l, *shape)}, state (b, width - 1, total) -> (ys as xs, new state)."""
        states = None if state is None else unfuse(state, self.parts)
        kernels, biases = self.arrays()
        ys, states = conv_parts_sharded(
            xs, kernels, biases, states, seq_idx, self.parts, impl=self.impl
        )
        return ys, fuse(states, self.parts, lead=2)

    def arrays(self) -> tuple[dict[str, jax.Array], dict[str, jax.Array] | None]:
        """The parts' kernels and biases (None without bias), as dicts of arrays."""
        return part_arrays(self)

    def step(
        self, xs: Mapping[str, jax.Array], state: jax.Array, *, silu: bool = False
    ) -> tuple[dict[str, jax.Array], jax.Array]:
        """One token: xs {part: (b, *shape)}, state (b, width - 1, total) -> (ys, new state);
        `silu` as layers/conv.py `causal_conv1d`'s."""
        x = fuse(xs, self.parts, lead=1)
        window = jnp.concatenate([state.astype(x.dtype), x[:, None]], axis=1).astype(jnp.float32)
        kernels, biases = self.arrays()
        kernel = fuse(kernels, self.parts, lead=1)
        y = jnp.einsum("bkc,kc->bc", window, kernel.astype(jnp.float32))
        if biases is not None:
            y = y + fuse(biases, self.parts, lead=0)
        if silu:
            y = jax.nn.silu(y)
        return unfuse(y.astype(x.dtype), self.parts), window[:, 1:].astype(x.dtype)


def conv_parts_sharded(xs, kernels, biases, states, seq_idx, parts: Sequence[Part], *, impl="auto"):
    """`conv_parts` per device (each on its batch rows and its parts' channels; a split "seq"
    passes one halo for all parts)."""
    names = [p.name for p in parts]
    outs = per_device(
        lambda **kw: _flat_outputs(conv_parts(**kw, order=names, impl=impl), names),
        dict(xs=xs, kernels=kernels, biases=biases, states=states, seq_idx=seq_idx),
        dict(
            xs={p.name: ("batch", "seq", *p.axes) for p in parts},
            kernels={p.name: (None, *p.axes) for p in parts},
            biases={p.name: p.axes for p in parts},
            states={p.name: ("batch", None, *p.axes) for p in parts},
            seq_idx=("batch", "seq"),
        ),
        [("batch", "seq", *p.axes) for p in parts] + [("batch", None, *p.axes) for p in parts],
        seq_aware=True,
    )
    return dict(zip(names, outs[: len(names)], strict=True)), dict(
        zip(names, outs[len(names) :], strict=True)
    )


def _flat_outputs(out: tuple[dict, dict], names) -> tuple:
    """(ys, states) dicts -> (*ys, *states) in `names` order (per_device's outputs are flat)."""
    return (*(out[0][n] for n in names), *(out[1][n] for n in names))


def conv_parts(xs, kernels, biases, states, seq_idx, order: Sequence[str], *, impl="auto"):
    """The causal conv (layers/conv.py `conv_shard`) of each part of this shard, the parts' channels
    side by side in `order` so a split "seq" passes one halo for all: xs {part: (b, l, *shape)},
    kernels {part: (width, *shape)}, biases {part: shape} or None, states {part: (b, width - 1,
    *shape)} -> (ys as xs, new states as states); impl as `causal_conv1d`'s."""
    x, _ = side_by_side(xs, order, lead=2)
    return conv_joined(x, kernels, biases, states, seq_idx, order, impl=impl)


def conv_joined(
    x,
    kernels,
    biases,
    states,
    seq_idx,
    order: Sequence[str],
    previous=None,
    *,
    silu=False,
    start=0,
    impl="auto",
    parts=None,
):
    """`conv_parts` on the parts already side by side in x (b, l, >= start + total) from channel
    `start`, e.g. a fused projection's whole output (read in place): -> (ys {part: (b, l,
    *shape)}, new states per part). `previous`: as `conv_shard`'s, joined the same way; `silu`
    and `impl` as its. Kernels and biases joined already (for_shard_map's `order` [JOINED]) are
    cut into `parts` (a sequence of Part) on the way out."""
    kernel, shapes = side_by_side(kernels, order, lead=1)
    bias = None if biases is None else side_by_side(biases, order, lead=0)[0]
    if parts is not None:
        order, shapes = [p.name for p in parts], [p.shape for p in parts]
    # Joined once and read: left to XLA, the join was fused into the conv's elementwise loops and
    # redone for every element (H200, HAX 64K: such loops took 1.2x the time per element of one
    # that read the joined kernel; on seq=2 the conv's own loop was one of them).
    kernel, bias = jax.lax.optimization_barrier((kernel, bias))
    state = None if states is None else side_by_side(states, order, lead=2)[0]
    widths = [math.prod(shape) for shape in shapes]
    ys, new_state = conv_shard(
        x,
        kernel,
        bias,
        state,
        seq_idx,
        previous,
        silu=silu,
        start=start,
        parts=widths,
        impl=impl,
    )
    ys = {
        name: y.reshape(*y.shape[:2], *shape)
        for name, y, shape in zip(order, ys, shapes, strict=True)
    }
    return ys, apart(new_state, order, shapes)
