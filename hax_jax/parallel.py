"""Ops per device under a mesh, and sequence parallelism by passing states between shards.

XLA cannot partition a Pallas kernel's custom call, and GSPMD partitions a scan over a split
sequence with dozens of collective-permutes. So the layers run their ops inside `jax.shard_map`
(`per_device`), every argument split by its logical axis names (the rules of hax_jax.sharding, so
the specs agree with the activations' constraints): batch over "data", channels / heads over
"tensor", and, for an op that handles it ("seq_aware"), positions over "seq" in contiguous shards.

A sequence-aware op runs on its shard as on one device and passes what the recurrence carries
(Mamba-2 paper §8.2): each shard's state from a zero start and its total decay are combined by an
exclusive prefix over "seq" (`incoming_states`: one small all-gather, or on two shards one
collective-permute to the second), and each shard then scans from its incoming state. The conv
takes a halo of its width - 1 inputs from the previous shard (`from_previous_shard`). Only states
and halos travel; no activation is gathered over "seq".
"""

import functools
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType, PartitionSpec

from hax_jax.sharding import current_mesh, logical_to_spec
from pallas_kernels.selective_scan import selective_scan
from pallas_kernels.ssd import ssd
from pallas_kernels.ssd.ops import resolve_impl, ssd_shard

SEQ = "seq"
Names = Sequence[str | None]  # one logical name per axis of an array
# What a shard receives from the others (halos, passed states, carried keys) is named so that a
# rematerialised block keeps it (`jax.checkpoint_policies.save_only_these_names(CARRIED)`): the
# backward's recompute then reruns no collective, and what it keeps is a few states per block.
CARRIED = "carried_between_shards"


def received(x: jax.Array) -> jax.Array:
    """x, named as received from other shards (what a rematerialised block keeps)."""
    return checkpoint_name(x, CARRIED)


def op_mesh(seq_aware: bool = False) -> jax.sharding.AbstractMesh | None:
    """The mesh to shard_map an op over, or None (call the op as it is).

    Under a mesh of several devices with Auto axes (not already inside shard_map), the mesh:
    each device runs the op on its own block (batch rows, heads / channels), which is all of the
    op's work that is its own; left to GSPMD, a scan or a kernel's custom call would be partitioned
    with resharding collectives, or not at all. With a split "seq" axis only a `seq_aware` op
    (it passes states between shards itself) is mapped; others are left to GSPMD (None)."""
    mesh = current_mesh()
    if mesh is None or mesh.size == 1:
        return None
    if any(kind != AxisType.Auto for kind in mesh.axis_types):
        return None
    if dict(mesh.shape).get(SEQ, 1) > 1 and not seq_aware:
        return None
    return mesh


def per_device(
    fn: Callable,
    args: Mapping[str, jax.Array | Mapping[str, jax.Array] | None],
    axes: Mapping[str, Names | Mapping[str, Names]],
    out_axes: Sequence[Names],
    *,
    seq_aware: bool = False,
):
    """fn(**args), inside shard_map over the mesh when `op_mesh(seq_aware)` gives one.

    `axes[name]` gives the logical axis names of args[name] (an argument that is None needs
    none; a dict of arrays, e.g. a fused layer's parts, a dict of names); `out_axes` those of fn's
    outputs (a tuple of arrays; one array if out_axes has one entry). An axis the mesh does not
    divide stays whole on every device, so fn must compute on its shard exactly what it computes on
    the whole; only a `seq_aware` fn sees a split "seq" (it must combine its shards itself), and
    there a sequence the "seq" axis does not divide is a ValueError naming both.
    """
    mesh = op_mesh(seq_aware)
    if mesh is None:
        return fn(**args)
    present = {name: a for name, a in args.items() if a is not None}
    shards = dict(mesh.shape)[SEQ]
    for name, a, names in _leaves(present, axes):
        if SEQ in names and a.shape[list(names).index(SEQ)] % shards:
            length = a.shape[list(names).index(SEQ)]
            raise ValueError(
                f"the sequence length {length} of {name} is not divisible by the mesh's "
                f"seq={shards}: every shard must hold the same number of positions"
            )
    in_specs = {
        n: {k: _manual_spec(axes[n][k], v.shape, mesh) for k, v in a.items()}
        if isinstance(a, Mapping)
        else _manual_spec(axes[n], a.shape, mesh)
        for n, a in present.items()
    }
    single = len(out_axes) == 1
    out_shapes = jax.eval_shape(lambda kw: fn(**kw, **_nones(args)), present)
    out_shapes = (out_shapes,) if single else out_shapes
    out_specs = tuple(
        _manual_spec(names, s.shape, mesh) for names, s in zip(out_axes, out_shapes, strict=True)
    )
    mapped = jax.shard_map(
        lambda kw: fn(**kw, **_nones(args)),
        mesh=mesh,
        in_specs=(in_specs,),
        out_specs=out_specs[0] if single else out_specs,
        check_vma=False,  # Pallas calls carry no varying-axes annotations
    )
    return mapped(present)


def _leaves(args: Mapping, axes: Mapping):
    """(label, array, logical names) of every array in `args`, one level of dicts opened."""
    for name, a in args.items():
        if isinstance(a, Mapping):
            for key, value in a.items():
                yield f"{name}[{key}]", value, axes[name][key]
        else:
            yield name, a, axes[name]


def _manual_spec(names: Names, shape, mesh) -> PartitionSpec:
    """`logical_to_spec`, with the mesh's size-one axes it leaves out folded into the first
    dimension (dividing by one changes nothing): a shard_map argument "replicated" over a
    size-one axis would have its cotangent psum'd over it, a no-op collective per argument."""
    spec = list(logical_to_spec(names, shape, mesh))
    trivial = [a for a, n in dict(mesh.shape).items() if n == 1 and a not in spec]
    if trivial and spec:
        spec[0] = tuple(([spec[0]] if spec[0] else []) + trivial)
    return PartitionSpec(*spec)


def _nones(args: Mapping[str, object]) -> dict:
    """The arguments that are None (they do not cross the shard_map boundary)."""
    return {name: None for name, a in args.items() if a is None}


def ssd_head_and_group_names(heads: int, groups: int) -> tuple[str | None, str | None]:
    """Logical names of the SSD's head and group axes for `per_device`: a device's heads must
    read their own groups. Head hh reads group hh // (heads // groups); on a shard of h' heads
    and g' groups the kernel maps local head i to local group i // (h' // g'). Groups split with
    the heads when the tensor size T divides them (device t holds heads t*h' ... and exactly
    their groups t*g' ...); one group is replicated (every head reads it). Otherwise (e.g. 12
    heads in 3 groups over T = 2: a device's 6 heads straddle groups of 4; or 2 groups over
    T = 4: a replicated pair of groups would be misread) nothing is split over "tensor"."""
    mesh = current_mesh()
    tensor = 1 if mesh is None else dict(mesh.shape).get("tensor", 1)
    if tensor == 1 or heads % tensor:
        return None, None
    if groups % tensor == 0:
        return "heads", "heads"
    return ("heads", None) if groups == 1 else (None, None)


# ----------------------------------------------------------------------------- between shards


def seq_shards() -> int:
    """How many shards the sequence is split into here: the "seq" size inside a shard_map over
    it, else 1."""
    mesh = current_mesh()
    if mesh is None or SEQ not in mesh.axis_names:
        return 1
    if mesh.axis_types[mesh.axis_names.index(SEQ)] != AxisType.Manual:
        return 1
    return dict(mesh.shape)[SEQ]


def top_k_over_sequence(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """jax.lax.top_k of x (b, l) along l, each shard of a split sequence taking its own top k
    first, then the top k of those: the same values and indices as
    one top_k (ties go to the lower position in both), where GSPMD would gather the whole (b, l)
    onto every device."""

    def shard_top_k(x):
        values, index = jax.lax.top_k(x, min(k, x.shape[1]))
        return values, index + jax.lax.axis_index(SEQ) * x.shape[1]  # positions in the row

    mesh = op_mesh(seq_aware=True)
    spec = None if mesh is None else logical_to_spec(("batch", SEQ), x.shape, mesh)
    if spec is None or spec[1] is None:  # the sequence is not split here
        return jax.lax.top_k(x, k)
    # Not per_device: each shard's output is (b, min(k, shard length)), not a shard of an output
    # whose whole shape fn would give.
    mapped = jax.shard_map(
        shard_top_k, mesh=mesh, in_specs=spec, out_specs=(spec, spec), check_vma=False
    )
    values, index = mapped(x)
    values, pick = jax.lax.top_k(values, k)  # over (b, shards x k): small
    return values, jnp.take_along_axis(index, pick, axis=1)


def from_previous_shard(tail: jax.Array, first: jax.Array) -> jax.Array:
    """`tail` of shard s - 1 on shard s, and `first` on shard 0 (same shape): a halo."""
    shards = seq_shards()
    if shards == 1:
        return first
    moved = received(jax.lax.ppermute(tail, SEQ, [(s, s + 1) for s in range(shards - 1)]))
    return on_first_shard(first, moved)


def on_first_shard(first: jax.Array, other: jax.Array) -> jax.Array:
    """`first` on shard 0 of "seq", `other` on the others (inside a map over the shards)."""
    return jnp.where(jax.lax.axis_index(SEQ) == 0, first, other)


def from_earlier_shards(x: jax.Array, axis: int) -> jax.Array:
    """Every shard's x side by side along `axis` (shard s's block at s * x.shape[axis]), as
    `all_gather(tiled=True)` lays them out, for readers of the earlier shards' blocks alone.

    On two shards one collective-permute brings the first shard's x to the second, where the
    result equals the all-gather's; on the first the block before its own is zeros and nothing
    is earlier. Only the second shard waits (an all-gather makes both wait for the slower), and
    the transpose is one collective-permute back instead of a reduce-scatter."""
    if seq_shards() == 2:
        return jnp.concatenate([from_previous_shard(x, jnp.zeros_like(x)), x], axis=axis)
    return received(jax.lax.all_gather(x, SEQ, axis=axis, tiled=True))


def from_last_shard(x: jax.Array) -> jax.Array:
    """The last shard's x, on every shard (a state after the whole sequence)."""
    shards = seq_shards()
    if shards == 1:
        return x
    last = jax.lax.axis_index(SEQ) == shards - 1
    return jax.lax.psum(jnp.where(last, x, jnp.zeros_like(x)), SEQ)


def incoming_states(
    decay: jax.Array, final: jax.Array, initial: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """(state entering this shard, state after the last shard) of a linear recurrence.

    Each shard's effect on the state is the affine map h -> decay * h + final (its total decay,
    broadcast against its final state from a zero start); the state entering shard s composes
    the maps of shards 0..s-1 onto `initial` (zeros if None). One all-gather of the pairs over
    "seq", then S cheap elementwise steps on every shard; on two shards one collective-permute
    of the first shard's pair, which only the second waits for (the state after the last shard
    then comes by a psum, which XLA drops where nothing reads it)."""
    h = jnp.zeros_like(final) if initial is None else initial.astype(final.dtype)
    shards = seq_shards()
    if shards == 1:
        return h, decay * h + final
    decay = decay.astype(final.dtype)
    # Both flattened side by side: one collective per scan, not two.
    packed = jnp.concatenate([decay.reshape(-1), final.reshape(-1)])

    def unpack(p):
        """(decays, finals) from packed pairs (..., pair)."""
        lead = p.shape[:-1]
        return (
            p[..., : decay.size].reshape(*lead, *decay.shape),
            p[..., decay.size :].reshape(*lead, *final.shape),
        )

    if shards == 2:
        decay_0, final_0 = unpack(from_previous_shard(packed, jnp.zeros_like(packed)))
        entering = on_first_shard(h, decay_0 * h + final_0)
        return entering, from_last_shard(decay * entering + final)
    decays, finals = unpack(received(jax.lax.all_gather(packed, SEQ)))
    entering = []
    for s in range(shards):
        entering.append(h)
        h = decays[s] * h + finals[s]
    return jnp.stack(entering)[jax.lax.axis_index(SEQ)], h


def incoming_state_grads(
    decay: jax.Array, d_entering: jax.Array, d_last: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """The transpose of `incoming_states`: (d state after this shard, d initial state) from each
    shard's gradient of its entering state through its own outputs (`d_entering`) and the
    gradient of the state after the last shard (`d_last`, summed over the shards; None: zero).
    The state after shard s enters shard s + 1, so its gradient runs backwards over the shards,
    g_s = d_entering_{s+1} + decay_{s+1} g_{s+1}: one all-gather of the pairs (on two shards
    without d_last, one collective-permute of the second shard's d_entering to the first). d
    initial is the first shard's (zeros on the others, so a sum over shards counts it once)."""
    shards = seq_shards()
    if shards == 1:
        d_last = jnp.zeros_like(d_entering) if d_last is None else d_last
        return d_last, d_entering + decay * d_last
    if shards == 2 and d_last is None:
        g = received(jax.lax.ppermute(d_entering, SEQ, [(1, 0)]))  # zeros on the second
        d_initial = d_entering + decay.astype(d_entering.dtype) * g
        return g, on_first_shard(d_initial, jnp.zeros_like(d_initial))
    parts = [decay.astype(d_entering.dtype), d_entering]
    if d_last is not None:  # None: a zero gradient, nothing to send for it
        parts.append(d_last.astype(d_entering.dtype))
    packed = received(jax.lax.all_gather(jnp.concatenate([a.reshape(-1) for a in parts]), SEQ))
    decays = packed[:, : decay.size].reshape(shards, *decay.shape)
    d_enterings = packed[:, decay.size : decay.size + d_entering.size]
    d_enterings = d_enterings.reshape(shards, *d_entering.shape)
    g = jnp.zeros_like(d_entering)
    if d_last is not None:
        # Summed over shards, as autodiff of `incoming_states` would (shard_map may hand the
        # gradient of an output that is the same on every shard to one shard only).
        g = jnp.sum(packed[:, decay.size + d_entering.size :], axis=0).reshape(d_last.shape)
    leaving = []
    for s in reversed(range(shards)):
        leaving.append(g)
        g = d_enterings[s] + decays[s] * g
    d_initial = on_first_shard(g, jnp.zeros_like(g))
    return jnp.stack(leaving[::-1])[jax.lax.axis_index(SEQ)], d_initial


# ----------------------------------------------------------------------------- the scans


def ssd_sequence_parallel(
    x, dt, A, B, C, D, initial_state, seq_idx, *, chunk_size: int, impl: str, block_sizes=None
) -> tuple[jax.Array, jax.Array]:
    """`pallas_kernels.ssd` (y, final state) of this shard of the sequence, exact to one device.

    Mamba-2 paper §8.2: `incoming_states` passes the shards' (total decay, state from a zero
    start) pairs, and the kernels run the shard once from the incoming state, as on one device.
    With the Pallas kernels (`ssd_shard`) the zero-start state is summed from the kernels' own
    chunk states, and the exchange and its transpose (`incoming_state_grads`) run inside their
    custom VJP; what the forward exchange received is named (`received`), so a rematerialised
    block keeps it and its recompute passes nothing again (the custom VJP's forward is traced
    in line, where the remat policy sees the name). Otherwise (the portable
    chunked path) the zero-start state is one matmul over the shard's positions
    (`_state_from_zero`) and autodiff transposes the exchange. A document that starts at the
    shard's first position (`seq_idx`) takes no incoming state."""
    kwargs = dict(
        chunk_size=chunk_size,
        D=D,
        return_final_state=True,
        seq_idx=seq_idx,
        impl=impl,
        block_sizes=block_sizes,
    )
    if seq_shards() == 1:
        return ssd(x, dt, A, B, C, initial_state=initial_state, **kwargs)
    starts_in_b, stays_in_b = _continues_document(seq_idx, x.shape[0])
    if resolve_impl(impl, x, dt, A, B, C, D, initial_state, chunk_size, None) == "pallas":
        # The kernels' own chunk states give the zero-start state (no extra pass over x).
        return ssd_shard(
            x,
            dt,
            A,
            B,
            C,
            chunk_size=chunk_size,
            exchange=(incoming_states, incoming_state_grads),
            keep_in=starts_in_b,
            D=D,
            initial_state=initial_state,
            seq_idx=seq_idx,
            block_sizes=block_sizes,
        )
    log_decay_bh = jnp.sum(dt.astype(jnp.float32) * A.astype(jnp.float32), axis=1)
    decay_bh = jnp.exp(log_decay_bh) * stays_in_b[:, None]
    final = _state_from_zero(x, dt, A, B, seq_idx)
    h_in, h_final = incoming_states(decay_bh[..., None, None], final, initial_state)
    h_in = h_in * starts_in_b[:, None, None, None]
    y, _ = ssd(x, dt, A, B, C, initial_state=h_in, **kwargs)
    return y, h_final


def _state_from_zero(x, dt, A, B, seq_idx) -> jax.Array:
    """(b, h, p, n) fp32: the SSD state after these positions from a zero state,

        sum_t exp(sum_{s > t} dt_s A) dt_t x_t B_t^T   over t in the last document (seq_idx),

    one matmul over positions (weights in fp32; the matmul in x's dtype, fp32 accumulation, as the
    kernels compute chunk states)."""
    b, l, h, p = x.shape
    g, n = B.shape[2:]
    dta_blh = dt.astype(jnp.float32) * A.astype(jnp.float32)
    # sum_{s > t}: a cumulative sum from the end, so the weights near the end are exact in fp32.
    from_end_blh = jnp.cumsum(dta_blh[:, ::-1], axis=1)[:, ::-1]
    after_blh = jnp.concatenate([from_end_blh[:, 1:], jnp.zeros_like(dta_blh[:, :1])], axis=1)
    weight_blh = jnp.exp(after_blh) * dt.astype(jnp.float32)
    if seq_idx is not None:
        weight_blh = weight_blh * (seq_idx == seq_idx[:, -1:])[..., None]
    xw_blgrp = (x.astype(jnp.float32) * weight_blh[..., None]).astype(x.dtype)
    xw_blgrp = xw_blgrp.reshape(b, l, g, h // g, p)
    state_bgrpn = jnp.einsum(
        "blgrp,blgn->bgrpn", xw_blgrp, B.astype(x.dtype), preferred_element_type=jnp.float32
    )
    return state_bgrpn.reshape(b, h, p, n)


def selective_scan_sequence_parallel(
    x,
    dt,
    A,
    B,
    C,
    D,
    z,
    initial_state,
    *,
    impl: str,
    recompute_states: bool = False,
    z_start: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """`pallas_kernels.selective_scan` (y, final state) of this shard, exact to one device.

    A first scan from a zero state gives the shard's final state; with its total decay
    exp(A sum_t dt_t) per (channel, state) the shards' states are passed (`incoming_states`);
    a second scan runs from the incoming state (the S6 state is per channel, so the incoming
    state's effect on y is not one cheap matmul as in SSD: the kernel applies it)."""
    scan = functools.partial(selective_scan, impl=impl, recompute_states=recompute_states)
    scan_gated = functools.partial(scan, D=D, z=z, z_start=z_start)  # z_start: as selective_scan's
    if seq_shards() == 1:
        return scan_gated(x, dt, A, B, C, initial_state=initial_state, return_final_state=True)
    _, final = scan(x, dt, A, B, C, return_final_state=True)
    dt_sum_bd = jnp.sum(dt.astype(jnp.float32), axis=1)
    decay_bdn = jnp.exp(dt_sum_bd[:, :, None] * A.astype(jnp.float32))
    h_in, h_final = incoming_states(decay_bdn, final, initial_state)
    y = scan_gated(x, dt, A, B, C, initial_state=h_in)
    return y, h_final


def _continues_document(seq_idx: jax.Array | None, b: int) -> tuple[jax.Array, jax.Array]:
    """(b,) floats (starts in it, stays in it): 1 where this shard's first position, and where
    all its positions, are in the document the previous shard ended in (on shard 0: the row's
    first document, which an initial state belongs to), else 0."""
    if seq_idx is None:
        return jnp.ones((b,), jnp.float32), jnp.ones((b,), jnp.float32)
    prev_last_b = from_previous_shard(seq_idx[:, -1], seq_idx[:, 0])
    same_bl = seq_idx == prev_last_b[:, None]
    return same_bl[:, 0].astype(jnp.float32), jnp.all(same_bl, axis=1).astype(jnp.float32)


def check_sequence_split(row_length: int, seq: int, mixer_kinds, chunk_size: int) -> None:
    """ValueError naming data.seq_len, mesh.seq and model.mamba2.chunk_size unless rows of
    `row_length` tokens split into `seq` equal shards, each a whole number of SSD chunks when a
    layer is Mamba-2 (its kernels tile a shard into chunks; a ragged one would pad each shard)."""
    if seq == 1:
        return
    if row_length % seq:
        raise ValueError(
            f"data.seq_len={row_length} (the rows' length) is not divisible by mesh.seq={seq}"
        )
    shard = row_length // seq
    if "mamba2" in mixer_kinds and shard % chunk_size:
        raise ValueError(
            f"data.seq_len={row_length} over mesh.seq={seq} gives shards of {shard} tokens, not "
            f"a whole number of SSD chunks (model.mamba2.chunk_size={chunk_size})"
        )
