"""Parameters gathered in the compute dtype where the model computes with nothing else.

Under mesh.param_gather="use" the fp32 parameters rest split and each step gathers them whole
before the loss. Most of them (the projections' kernels) the model only ever reads cast to its
compute dtype (bf16): for those, gathering the bf16 cast moves half the bytes and
changes no number the model computes. Which leaves qualify is read from the loss's jaxpr
(`cast_at_every_use`): a leaf every use of which is a cast to the compute dtype. Such a leaf
reaches the model as fp32(bf16(p)), which its casts map to the bf16 values they made before,
and its gradient passes back unchanged in fp32 (`gathered`), as autodiff of the model's own
casts gives it; every other leaf is gathered in fp32, as before.
"""

import functools

import jax
import jax.numpy as jnp
from jax.extend import core

_CAST = "convert_element_type"
# Calls whose body sees the call's operands as its own inputs, one to one (remat, jit, the
# maps over devices, loops). Anything else that reads a leaf (custom VJPs among them: their
# backward may read it as it is) leaves it in fp32.
_CALLS = ("jit", "pjit", "closed_call", "remat2", "checkpoint", "shard_map", "scan")
# Calls whose outputs are their body's outputs, one to one, computed once (not a loop's carry, not
# a device's piece of a whole): a body's input returned as it is comes out of the call unchanged.
_PASS_THROUGH = ("jit", "pjit", "closed_call", "remat2", "checkpoint")


def cast_at_every_use(fn, args: tuple, dtype):
    """A pytree like `args` of bools: whether every use of the leaf in fn(*args)'s jaxpr is a
    cast to `dtype` (through the calls of _CALLS). Traced on abstract values, so `args` may be
    tracers or arrays."""
    leaves, tree = jax.tree.flatten(args)
    abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
    closed = jax.make_jaxpr(lambda *xs: fn(*jax.tree.unflatten(tree, xs)))(*abstract)
    flags = [_only_cast(closed.jaxpr, var, jnp.dtype(dtype)) for var in closed.jaxpr.invars]
    return jax.tree.unflatten(tree, flags)


def _only_cast(jaxpr, var, dtype) -> bool:
    """Whether every use of `var` in `jaxpr` (and the bodies of its calls) casts it to dtype."""
    ok, returned = _uses(jaxpr, var, dtype)
    return ok and not returned


def _uses(jaxpr, var, dtype) -> tuple[bool, list[int]]:
    """(whether every use of `var` in `jaxpr` but being returned casts it to dtype, the positions
    in jaxpr's outputs where it is returned as it is)."""
    returned = [j for j, out in enumerate(jaxpr.outvars) if out is var]
    for eqn in jaxpr.eqns:
        for i, operand in enumerate(eqn.invars):
            if operand is not var:
                continue
            if eqn.primitive.name == _CAST:
                if eqn.params["new_dtype"] != dtype:
                    return False, returned
            elif eqn.primitive.name in _CALLS:
                body = _body(eqn)
                if body is None:
                    return False, returned
                ok, passed = _uses(body, body.invars[i], dtype)
                if not ok or (passed and eqn.primitive.name not in _PASS_THROUGH):
                    return False, returned
                # The call hands the value back out unchanged (nnx.remat returns the module's
                # state): the uses of that output are the leaf's too.
                for j in passed:
                    ok, again = _uses(jaxpr, eqn.outvars[j], dtype)
                    if not ok:
                        return False, returned
                    returned += again
            else:
                return False, returned
    return True, returned


def _body(eqn):
    """The jaxpr of a call in _CALLS whose inputs are the call's operands, or None."""
    for value in eqn.params.values():
        body = value.jaxpr if isinstance(value, core.ClosedJaxpr) else value
        if isinstance(body, core.Jaxpr) and len(body.invars) == len(eqn.invars):
            return body
    return None


def gathered(params: dict, resting: dict, shardings: dict, castable: dict, dtype) -> dict:
    """params (sharded as `resting`) resharded to `shardings`; where `castable` (a pytree of
    bools like params) in `dtype` (see the module's docstring), else as they are."""

    def one(p, rest, sharding, cast):
        if cast:
            return _gathered_in(p, rest, sharding, jnp.dtype(dtype))
        return jax.lax.with_sharding_constraint(p, sharding)

    return jax.tree.map(one, params, resting, shardings, castable)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _gathered_in(p, rest, sharding, dtype):
    """p gathered from `rest` to `sharding` as its cast to `dtype`, returned in p's dtype. The
    cast is held to p's own sharding: left free, XLA's partitioner gives it the gathered one and
    gathers p before casting."""
    cast = jax.lax.with_sharding_constraint(p.astype(dtype), rest)
    return jax.lax.with_sharding_constraint(cast, sharding).astype(p.dtype)


def _gathered_in_fwd(p, rest, sharding, dtype):
    return _gathered_in(p, rest, sharding, dtype), None


def _gathered_in_bwd(rest, sharding, dtype, residuals, ct):
    """The gradient unchanged: every use casts the value to dtype, whose transpose already gave
    it back in p's dtype."""
    del rest, sharding, dtype, residuals
    return (ct,)


_gathered_in.defvjp(_gathered_in_fwd, _gathered_in_bwd)
