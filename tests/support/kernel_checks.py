"""Checks shared by the kernel tests: closeness (elementwise, or to the array's scale when
compiled on a GPU), the largest array a jaxpr produces, and the selective scan's random inputs."""

import jax.numpy as jnp
import numpy as np

# Set (monkeypatch.setitem) by the tests that run compiled on a GPU: the GPU sums in another
# order than XLA, which moves single cancellation-prone elements past an elementwise 1e-5
# (seen: 2e-5 on 1 of 10^6 elements) while the array as a whole stays at 1e-6 of its scale.
COMPILED = {"on": False}


def assert_close(actual, desired, tol, name=""):
    """assert_allclose(**tol) on fp32 copies; when COMPILED["on"], the largest error relative
    to the array's largest magnitude must stay within tol["atol"] instead."""
    actual, desired = np.asarray(actual, np.float32), np.asarray(desired, np.float32)
    if COMPILED["on"]:
        err = np.max(np.abs(actual - desired)) / max(np.max(np.abs(desired)), 1e-30)
        assert err <= tol["atol"], f"{name}: error {err:.2e} of the scale > {tol['atol']}"
        return
    np.testing.assert_allclose(actual, desired, err_msg=name, **tol)


def largest_array(jaxpr):
    """Elements of the largest array produced anywhere in a jaxpr, sub-jaxprs included."""
    biggest = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            biggest = max(biggest, int(np.prod(getattr(var.aval, "shape", ()))))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    biggest = max(biggest, largest_array(sub))
    return biggest


SCAN_OPTIONAL = ("D", "z", "initial_state")


def selective_scan_inputs(b, l, d, n, seed=0, dtype=jnp.float32, optional=SCAN_OPTIONAL):
    """Random S6 inputs (numpy RNG: no per-op compiles): positive dt, negative A; optional inputs
    not named in `optional` are None."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape, np.float32)  # noqa: E731
    inputs = dict(
        x=normal(b, l, d),
        dt=np.log1p(np.exp(normal(b, l, d) - 1.0)),  # softplus
        A=-np.exp(normal(d, n)),
        B=normal(b, l, n),
        C=normal(b, l, n),
        D=normal(d),
        z=normal(b, l, d),
        initial_state=normal(b, d, n),
    )
    return {
        k: (jnp.asarray(v, dtype) if k not in SCAN_OPTIONAL or k in optional else None)
        for k, v in inputs.items()
    }
