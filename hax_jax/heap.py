"""Python's garbage collector around a training loop.

Tracing and compiling a step leaves about a million long-lived Python objects (jaxprs, lowering
caches, the model's graph: HAX-Mamba-2 130M). Each full collection walks them all: on 2 x H200 one
took 0.36 s inside the timed steps of a 278 ms HAX step (BENCHMARKS.md, eighteenth session), a
host stall the GPUs wait through. Frozen into the permanent generation once the step has compiled,
those objects are skipped by every later pass; new objects are still collected as before.
"""

import contextlib
import gc


@contextlib.contextmanager
def frozen_after_compile():
    """Yields `freeze()`: its first call collects and then freezes every object alive (call it once
    the step has compiled; later calls do nothing), whether or not something froze objects before
    (the GPU machines' Python 3.12 starts with 375 frozen). On exit every frozen object returns to
    the collector, those frozen before too: `gc.unfreeze` cannot tell them apart, and freezing is
    only a hint, while a frozen cycle is never freed (a finished run's arrays would stay)."""
    frozen = False

    def freeze():
        nonlocal frozen
        if not frozen:
            gc.collect()  # garbage left by compiling is freed now, not kept frozen
            gc.freeze()
            frozen = True

    try:
        yield freeze
    finally:
        if frozen:
            gc.unfreeze()
