"""Logical-axis sharding: the device mesh, one rules table, parameter shardings, activation
constraints.

Parameters carry a `logical_axes` metadata tuple (one logical name or None per axis), set where they
are built (`kernel_metadata={"logical_axes": ...}` on nnx.Linear, `logical_axes=...` on a raw
nnx.Param). The rules map logical names to mesh axes; FSDP is a rule change ("embed" -> "data"
and "seq").
Activations are constrained with `shard(x, "batch", "seq", "embed")` at block boundaries only; GSPMD
propagates the rest. `shard` reads the mesh set by `jax.set_mesh(mesh)` (the abstract mesh, also
visible inside `jax.jit`) and does nothing when none is set, so single-device use is unchanged.
"""

import math
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from hax_jax.config import MeshConfig

MESH_AXES = ("data", "seq", "tensor")

# Logical name -> mesh axis (None = replicated). Tensor parallelism splits d_inner / heads / d_ff /
# vocab; d_model ("embed") stays whole unless FSDP; SSM state, conv taps, dt rank and the scorer's
# small widths ("state") are never split.
RULES: tuple[tuple[str, str | None], ...] = (
    ("batch", "data"),  # activations: the batch
    ("seq", "seq"),  # activations: the sequence
    ("embed", None),  # d_model (FSDP: "data" and "seq")
    ("inner", "tensor"),  # Mamba d_inner (and fused projections built from it)
    ("heads", "tensor"),  # attention / Mamba-2 heads (flattened heads x head_dim too)
    ("groups", "tensor"),  # Mamba-2 B / C groups (one group: replicated, every head reads it)
    ("mlp", "tensor"),  # SwiGLU d_ff
    ("vocab", "tensor"),  # embedding rows / logits
    ("state", None),  # d_state, dt rank, conv taps, scorer widths: small, replicated
)
# FSDP: parameters' d_model over "data" and "seq" (each device of either holds a whole replica
# otherwise), so on a split sequence the parameters and their AdamW state shrink with the shards.
FSDP_RULES = tuple((name, ("data", "seq") if name == "embed" else axis) for name, axis in RULES)
# mesh.shard_optimizer: the AdamW moments and the update split d_model over every axis the
# gradients are summed over ("data" and "seq": each device of either holds a whole replica).
OPTIMIZER_RULES = tuple(
    (name, ("data", "seq") if name == "embed" else axis) for name, axis in RULES
)

Rules = Sequence[tuple[str, str | tuple[str, ...] | None]]


def rules(fsdp: bool = False) -> Rules:
    """The rules table; with `fsdp`, parameters' d_model axis ("embed") is also split over
    "data" and "seq"."""
    return FSDP_RULES if fsdp else RULES


def linear_axes(in_axis: str | None, out_axis: str | None) -> dict:
    """nnx.Linear keyword arguments giving its kernel (in, out) and bias (out,) their logical
    axes."""
    return {
        "kernel_metadata": {"logical_axes": (in_axis, out_axis)},
        "bias_metadata": {"logical_axes": (out_axis,)},
    }


# ----------------------------------------------------------------------------- mesh


def mesh_shape(cfg: MeshConfig, n_devices: int) -> tuple[int, int, int]:
    """(data, seq, tensor) sizes for `n_devices`, with a -1 resolved; ValueError naming the
    values."""
    sizes = {name: getattr(cfg, name) for name in MESH_AXES}
    text = " x ".join(f"{k}={v}" for k, v in sizes.items())
    bad = [f"{k}={v}" for k, v in sizes.items() if v != -1 and v < 1]
    if bad:
        raise ValueError(f"mesh sizes must be positive or -1, got {', '.join(bad)} (mesh {text})")
    free = [k for k, v in sizes.items() if v == -1]
    if len(free) > 1:
        raise ValueError(
            "at most one mesh size may be -1, got "
            f"{', '.join(f'{k}=-1' for k in free)} (mesh {text})"
        )
    fixed = math.prod(v for v in sizes.values() if v != -1)
    if free:
        if fixed > n_devices or n_devices % fixed:
            raise ValueError(
                f"mesh {text}: the fixed sizes' product {fixed} does not divide the "
                f"{n_devices} available devices"
            )
        sizes[free[0]] = n_devices // fixed
    elif fixed > n_devices:
        raise ValueError(f"mesh {text} = {fixed} devices, but only {n_devices} are available")
    elif fixed != n_devices and jax.process_count() > 1:
        raise ValueError(
            f"mesh {text} = {fixed} devices, but {n_devices} are available over "
            f"{jax.process_count()} processes; a multi-process mesh must use all of them"
        )
    return tuple(sizes[name] for name in MESH_AXES)


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The ("data", "seq", "tensor") mesh over `devices` (default: all), with Auto axes.

    A mesh smaller than the devices uses the first ones (e.g. data=seq=tensor=1: one device).

    Auto axes let GSPMD place every intermediate (no `out_sharding=` on matmuls, unlike the Explicit
    axes of `jax.make_mesh`).
    """
    devices = np.asarray(jax.devices() if devices is None else devices).reshape(-1)
    shape = mesh_shape(cfg, devices.size)
    used = devices[: math.prod(shape)]
    # A mesh of every device follows their links; a smaller one (tests, a one-device baseline)
    # takes the first devices as they come.
    grid = device_grid(used, shape) if used.size == devices.size else used.reshape(shape)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def device_grid(devices: np.ndarray, shape: tuple[int, int, int]) -> np.ndarray:
    """`devices` laid out as the (data, seq, tensor) mesh `shape`, by the links between them.

    Several TPU slices (distinct `slice_index`): "data" spans the slices over the data-centre
    network, slice by slice, and within a slice the axes follow its torus (jax's hybrid mesh);
    "seq" and "tensor" never cross a slice. One TPU slice: the axes follow its torus. GPUs: XLA's
    global device numbering (ids), so "tensor", the innermost axis, stays within a host while
    it fits one. CPU: as given.
    """
    tpu = devices[0].platform == "tpu"
    slices = len({getattr(d, "slice_index", 0) for d in devices}) if tpu else 1
    if slices > 1:
        data, seq, tensor = shape
        if data % slices:
            raise ValueError(
                f"mesh.data={data} must be a multiple of the {slices} TPU slices: only the data "
                f"axis crosses slices (mesh data={data} x seq={seq} x tensor={tensor})"
            )
        return mesh_utils.create_hybrid_device_mesh(
            (data // slices, seq, tensor), (slices, 1, 1), list(devices)
        )
    if devices[0].platform in ("tpu", "gpu"):
        return mesh_utils.create_device_mesh(shape, list(devices), allow_split_physical_axes=True)
    return devices.reshape(shape)


# ----------------------------------------------------------------------------- specs


def logical_to_spec(
    names: Sequence[str | None],
    shape: Sequence[int],
    mesh: Mesh | jax.sharding.AbstractMesh,
    rules: Rules = RULES,
) -> PartitionSpec:
    """The PartitionSpec of an array `shape` whose axes have logical `names`.

    An axis stays replicated when its name maps to no mesh axis, the mesh axis has size 1 or is
    absent or already used by an earlier axis of this spec, or the axis size is not divisible by the
    mesh axis size (odd fused widths, a batch of 1). Unknown names are errors.
    """
    if len(names) != len(shape):
        raise ValueError(f"logical axes {tuple(names)} do not match the shape {tuple(shape)}")
    table = dict(rules)
    sizes = dict(mesh.shape)
    used: set[str] = set()
    spec = []
    for name, size in zip(names, shape):
        if name is not None and name not in table:
            raise ValueError(f"unknown logical axis {name!r}; the rules name {tuple(table)}")
        axes = split_axes(None if name is None else table[name], sizes)
        if not axes or used & set(axes) or size % math.prod(sizes[a] for a in axes):
            spec.append(None)
            continue
        used.update(axes)
        spec.append(axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*spec)


def split_axes(axis: str | tuple[str, ...] | None, sizes: dict) -> tuple[str, ...]:
    """The mesh axes of size > 1 among `axis` (a rule's or a PartitionSpec entry: None, one name or
    several)."""
    names = () if axis is None else (axis,) if isinstance(axis, str) else axis
    return tuple(a for a in names if sizes.get(a, 1) > 1)


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def param_shardings(state, mesh: Mesh, rules: Rules = RULES):
    """NamedShardings for an nnx State (or a Module) of Params, abstract or concrete.

    Returns the same State structure with each Variable holding its NamedSharding (as
    `nnx.get_named_sharding` does), ready for `jax.device_put(state, shardings)` and jit shardings.
    Every Variable must carry `logical_axes` metadata; else a ValueError names its path.
    """
    if isinstance(state, nnx.Module):
        state = nnx.state(state, nnx.Param)

    def one(path, var):
        if not _is_variable(var):
            raise ValueError(f"parameter {jax.tree_util.keystr(path)} is not an nnx.Variable")
        names = var.get_metadata().get("logical_axes")
        where = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        if names is None:
            raise ValueError(
                f"parameter {where!r} (shape {var.shape}) has no logical_axes metadata"
            )
        if len(names) != len(var.shape):
            raise ValueError(
                f"parameter {where!r}: logical_axes {tuple(names)} do not match "
                f"its shape {var.shape}"
            )
        return var.replace(NamedSharding(mesh, logical_to_spec(names, var.shape, mesh, rules)))

    return jax.tree_util.tree_map_with_path(one, state, is_leaf=_is_variable)


def check_param_splits(state, mesh: Mesh, rules: Rules = RULES) -> None:
    """ValueError naming the first parameters whose axis the rules split over a mesh axis of size
    > 1 that does not divide it (logical_to_spec would leave it whole on every device: the split
    asked for, e.g. by mesh.tensor, would silently not happen). An axis of size one is whole by
    design (Mamba-2's single B / C group, which every head reads)."""
    table, sizes = dict(rules), dict(mesh.shape)
    shapes = nnx.to_pure_dict(
        state if not isinstance(state, nnx.Module) else nnx.state(state, nnx.Param)
    )
    bad = []
    for path, names in jax.tree_util.tree_leaves_with_path(
        logical_axes_dict(state), is_leaf=lambda x: isinstance(x, tuple)
    ):
        shape = _leaf(shapes, path).shape
        for name, size in zip(names, shape, strict=True):
            axes = split_axes(table.get(name) if name is not None else None, sizes)
            if axes and size % math.prod(sizes[a] for a in axes) and size > 1:
                where = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
                over = " x ".join(f"mesh.{a}={sizes[a]}" for a in axes)
                bad.append(f"{where} ({name} = {size}) over {over}")
    if bad:
        raise ValueError(
            "the mesh cannot split these parameters: "
            + "; ".join(bad[:4])
            + "; choose mesh sizes that divide them, or widths they divide (for the vocabulary: "
            "model.pad_vocab_size_multiple)"
        )


def _leaf(tree: dict, path):
    """The leaf of a nested dict at a tree path."""
    for key in path:
        tree = tree[getattr(key, "key", getattr(key, "idx", key))]
    return tree


def param_shardings_dict(state, mesh: Mesh, rules: Rules = RULES) -> dict:
    """`param_shardings` as a pure dict (the layout of `nnx.to_pure_dict(state)`)."""
    return nnx.to_pure_dict(param_shardings(state, mesh, rules))


def logical_axes_dict(state) -> dict:
    """The `logical_axes` of every Param, as a pure dict (None where a Variable has none)."""
    if isinstance(state, nnx.Module):
        state = nnx.state(state, nnx.Param)
    return nnx.to_pure_dict(state, lambda v: v.get_metadata().get("logical_axes"))


# ----------------------------------------------------------------------------- batches


def process_rows(batch_size: int, mesh: Mesh, rules: Rules = RULES) -> tuple[int, int]:
    """[start, stop) of a global batch's rows that this process's devices hold.

    Derived from the mesh, not the process count: where "data" does not split the rows across
    processes (data=1 with seq or tensor over two hosts), every process holds all of them.
    """
    spec = logical_to_spec(("batch",), (batch_size,), mesh, rules)
    held = NamedSharding(mesh, spec).addressable_devices_indices_map((batch_size,))
    ranges = [index[0].indices(batch_size)[:2] for index in held.values()]
    return min(r[0] for r in ranges), max(r[1] for r in ranges)


def global_batch_array(
    local: np.ndarray,
    rows: tuple[int, int],
    batch_size: int,
    names: Sequence[str],
    mesh: Mesh,
    rules: Rules = RULES,
) -> jax.Array:
    """The global (batch_size, ...) array laid out by the logical `names`, of which this process
    holds rows `rows` (from `process_rows`) as `local`; each device takes its own block of them
    (rows, and positions when "seq" splits them)."""
    shape = (batch_size, *local.shape[1:])
    if local.shape[0] != rows[1] - rows[0]:
        raise ValueError(f"{local.shape[0]} local rows, but this process holds rows {rows}")
    sharding = NamedSharding(mesh, logical_to_spec(names, shape, mesh, rules))

    def block(index: tuple[slice, ...]) -> np.ndarray:
        """The block of a device at global `index`, from this process's rows."""
        start, stop, _ = index[0].indices(batch_size)
        return local[(slice(start - rows[0], stop - rows[0]), *index[1:])]

    return jax.make_array_from_callback(shape, sharding, block)


# ----------------------------------------------------------------------------- activations


def current_mesh() -> jax.sharding.AbstractMesh | None:
    """The mesh set by `jax.set_mesh` (also inside jit), or None when none is set."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def shard(x: jax.Array, *names: str | None, rules: Rules | None = None) -> jax.Array:
    """Constrains x to the logical `names` (one per axis) under the current mesh; no-op without one.

    Inside `jax.shard_map` the manual axes are left out (they are already split). The rules default
    to RULES: activations never use "embed", so FSDP does not change them.
    """
    mesh = current_mesh()
    if mesh is None:
        return x
    manual = {
        name for name, kind in zip(mesh.axis_names, mesh.axis_types) if kind == AxisType.Manual
    }
    table = [(n, None if a in manual else a) for n, a in (RULES if rules is None else rules)]
    spec = logical_to_spec(names, x.shape, mesh, table)
    if all(axis is None for axis in spec) and manual:
        return x
    return jax.lax.with_sharding_constraint(x, spec)
