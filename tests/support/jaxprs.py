"""Walking a jaxpr and the jaxprs nested in its equations (scan, while, cond, pjit, custom_vjp,
checkpoint, ...), for tests that read what a program computes."""


def sub_jaxprs(eqn):
    """The jaxprs an equation carries in its params (cond's branches come as a tuple), each as a
    Jaxpr (a ClosedJaxpr's unwrapped)."""
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            inner = getattr(item, "jaxpr", item)
            if hasattr(inner, "eqns"):
                yield inner


def equations(jaxpr):
    """Every equation of `jaxpr` (a Jaxpr or ClosedJaxpr) and of the jaxprs nested in it."""
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        yield eqn
        for sub in sub_jaxprs(eqn):
            yield from equations(sub)


def live(closed_jaxpr):
    """`closed_jaxpr`'s Jaxpr with the equations no output needs dropped, as XLA drops them when
    it compiles (partial evaluation under remat leaves dead calls). jax's DCE prunes inside jit and
    remat, not inside shard_map bodies: count there in the compiled program instead."""
    from jax._src.interpreters import partial_eval as pe  # no public API does this

    jaxpr = closed_jaxpr.jaxpr
    return pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))[0]


def primitives(jaxpr):
    """Every equation's primitive name, nested jaxprs included."""
    return (eqn.primitive.name for eqn in equations(jaxpr))
