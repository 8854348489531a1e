"""Rows chosen at run time, for both kernel variants: "gpu" (Triton) indexes the whole array
through pointers; "tpu" (Mosaic, whose blocks cannot follow data) copies the rows between HBM
and VMEM by DMA and keeps schedules and index arrays in SMEM. `Specs` gives each variant's
block specs at the call site, `Loader` the matching reads and writes inside a kernel.
"""

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


class Specs:
    """Block specs of one variant; every grid starts with the batch axis."""

    def __init__(self, variant):
        self.variant = variant

    @staticmethod
    def rows(rows, width, index):
        """(b, L, f) array: the (rows, width) block at (row block, col block) = index(*grid)."""
        return pl.BlockSpec((None, rows, width), lambda b, *g: (b, *index(*g)))

    @staticmethod
    def slab(shape, index):
        """(b, nblocks, h, w) array: the (h, w) block at (block, 0, col block) = index(*grid)."""
        return pl.BlockSpec((None, None, *shape), lambda b, *g: (b, *index(*g)))

    def whole(self, x):
        """An array (or output) used at run-time rows (3-d) or read as scalars and index rows
        (schedules and orders, 1-d / 2-d)."""
        if self.variant == "tpu":
            return pl.BlockSpec(memory_space=pl.ANY if x.ndim == 3 else pltpu.SMEM)
        if x.ndim == 3:
            return pl.BlockSpec((None, *x.shape[1:]), lambda b, *g: (b, 0, 0))
        return pl.BlockSpec(x.shape, lambda *g: (0,) * x.ndim)

    def scratch(self, slots):
        """tpu: a VMEM buffer per Loader slot (name, shape, dtype), then a DMA semaphore."""
        if self.variant != "tpu":
            return []
        return [pltpu.VMEM(shape, dtype) for _, shape, dtype in slots] + [pltpu.SemaphoreType.DMA]


class Loader:
    """Rows, chosen at run time, of (b, rows, f) arrays the kernel sees whole: a run of rows
    (`__call__`) or the rows an index array lists (`gather`, `scatter`: the lsh kernels read
    and write values in position order while walking the sorted order). gpu: Triton pointer
    arithmetic on the whole-array ref; tpu: DMAs between HBM and the VMEM buffer of the named
    slot (scratch holds one buffer per slot, in `slots` order, then a DMA semaphore)."""

    def __init__(self, slots, scratch):
        self.bufs = dict(zip(slots, scratch[:-1])) if scratch else None
        self.sem = scratch[-1] if scratch else None
        # Read at the kernel's top level: interpret mode cannot see program_id in a cond.
        self.b = pl.program_id(0)

    def __call__(self, slot, ref, start, size, cols):
        """Rows [start, start + size) and columns `cols` (a pl.ds) of this batch row."""
        if self.bufs is None:
            return ref[pl.ds(start, size), cols]
        buf = self.bufs[slot]
        copy = pltpu.make_async_copy(ref.at[self.b, pl.ds(start, size), cols], buf, self.sem)
        copy.start()
        copy.wait()
        return buf[...]

    def gather(self, slot, ref, index_ref, start, size, cols):
        """Rows index[b, start:start + size] of ref, columns `cols`."""
        b = self.b
        if self.bufs is None:
            return ref[index_ref[b, pl.ds(start, size)], cols]
        buf = self.bufs[slot]

        def copy(r):
            """Row r of the buffer from its source row."""
            row = ref.at[b, pl.ds(index_ref[b, start + r], 1), cols]
            return pltpu.make_async_copy(row, buf.at[pl.ds(r, 1)], self.sem)

        self._each_row(size, copy)
        return buf[...]

    def scatter(self, slot, ref, index_ref, start, cols, value):
        """ref[b, index[b, start:start + rows], cols] = value."""
        b = self.b
        if self.bufs is None:
            ref[index_ref[b, pl.ds(start, value.shape[0])], cols] = value
            return
        buf = self.bufs[slot]
        buf[...] = value

        def copy(r):
            """Row r of the buffer to its destination row."""
            row = ref.at[b, pl.ds(index_ref[b, start + r], 1), cols]
            return pltpu.make_async_copy(buf.at[pl.ds(r, 1)], row, self.sem)

        self._each_row(value.shape[0], copy)

    @staticmethod
    def _each_row(size, copy):
        """Start copy(r) for every row r, then wait for all of them."""

        def start(r, carry):
            """Issue row r."""
            copy(r).start()
            return carry

        def wait(r, carry):
            """Wait for row r."""
            copy(r).wait()
            return carry

        jax.lax.fori_loop(0, size, start, 0)
        jax.lax.fori_loop(0, size, wait, 0)
