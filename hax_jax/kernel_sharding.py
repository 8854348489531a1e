"""Pallas kernels under a multi-device mesh: each device runs the kernel on its own shard.

XLA cannot partition a kernel's custom call, so under train.py's ("data", "seq", "tensor") mesh
with Auto axes the ops' impl="auto" falls back to the pure-JAX paths (GSPMD partitions those).
`per_device` instead runs the op inside `jax.shard_map`, with every argument split by its logical
axis names (the rules of hax_jax.sharding, so the specs agree with the activations' constraints):
batch over "data", channels / heads over "tensor"; an axis its mesh axis does not divide stays
whole (every device computes all of it, so the result is unchanged). The recurrences and the
attention run over the whole sequence, so with a "seq" axis larger than one the op is called as
before: impl="auto" takes the pure-JAX paths, which XLA partitions (an explicit impl="pallas"
runs the unsplit kernel).
"""

from collections.abc import Callable, Sequence

import jax
from jax.sharding import AxisType, PartitionSpec

from hax_jax.sharding import current_mesh, logical_to_spec
from pallas_kernels import backend

Names = Sequence[str | None] | None  # one logical name per axis of an argument; None: no argument


def kernel_mesh(impl: str) -> jax.sharding.AbstractMesh | None:
    """The mesh to shard_map an op over: the current mesh when `impl` runs Pallas kernels
    ("pallas", or "auto" where `backend.kernels_by_default()`: a GPU), it has several devices,
    its axes are Auto (not already inside shard_map) and its "seq" axis has size one; else None
    (call the op as it is). Inside shard_map "auto" takes the kernels (`auto_picks_pallas`), or
    the op's pure-JAX path per device where the kernels do not take its arguments."""
    mesh = current_mesh()
    if mesh is None or mesh.size == 1 or dict(mesh.shape).get("seq", 1) > 1:
        return None
    if any(kind != AxisType.Auto for kind in mesh.axis_types):
        return None
    if impl == "pallas" or (impl == "auto" and backend.kernels_by_default()):
        return mesh
    return None


def per_device(
    fn: Callable, impl: str, args: Sequence, in_names: Sequence[Names], out_names: Sequence[Names]
):
    """fn(*args), inside shard_map over the mesh when `kernel_mesh(impl)` gives one.

    `in_names[i]` names the axes of args[i] (None for an argument that is None); `out_names`
    names the axes of fn's outputs (a tuple of arrays, or one array if out_names has one entry).
    Inside, fn sees each device's shard and must compute on it exactly what it computes on the
    whole (no reduction across a split axis)."""
    mesh = kernel_mesh(impl)
    if mesh is None:
        return fn(*args)
    single = len(out_names) == 1

    def spec(names, shape):
        return None if names is None else logical_to_spec(names, shape, mesh)

    in_specs = tuple(
        None if a is None else spec(n, a.shape) for a, n in zip(args, in_names, strict=True)
    )
    out_shapes = jax.eval_shape(fn, *args)
    out_shapes = (out_shapes,) if single else out_shapes
    out_specs = tuple(spec(n, s.shape) for n, s in zip(out_names, out_shapes, strict=True))
    mapped = jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=tuple(PartitionSpec() if s is None else s for s in in_specs),
        out_specs=out_specs[0] if single else out_specs,
        check_vma=False,  # Pallas calls carry no varying-axes annotations
    )
    return mapped(*args)


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
