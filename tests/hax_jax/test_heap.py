"""hax_jax.heap: the objects alive once the step compiled are frozen out of Python's collector."""

import gc
import weakref

from hax_jax import heap


class _Node:
    """A reference cycle: freed by the cycle collector only."""

    def __init__(self):
        self.me = self


def _dropped_cycle() -> weakref.ref:
    return weakref.ref(_Node())


def test_freeze_collects_first_then_freezes_once_and_releases_on_exit():
    before = gc.get_freeze_count()  # 0 here; 375 on the GPU machines' Python
    with heap.frozen_after_compile() as freeze:
        assert gc.get_freeze_count() == before  # nothing before the first call
        garbage = _dropped_cycle()
        freeze()
        assert garbage() is None  # garbage left before freezing is freed, not kept
        frozen = gc.get_freeze_count()
        assert frozen > before
        kept = [_Node() for _ in range(1000)]
        freeze()  # later calls freeze nothing more (frozen objects may still be freed: <=)
        assert gc.get_freeze_count() <= frozen
        later = _dropped_cycle()
        gc.collect()
        assert later() is None  # objects made after freezing are still collected
    assert gc.get_freeze_count() == 0
    del kept


def test_freezes_also_after_someone_elses_freeze_and_releases_everything():
    # The GPU machines' Python starts with objects frozen (375): the freeze must not depend on 0,
    # and what the loop froze must not stay frozen (a frozen cycle is never collected).
    gc.freeze()
    try:
        theirs = gc.get_freeze_count()
        with heap.frozen_after_compile() as freeze:
            made_after = [_Node() for _ in range(1000)]
            freeze()
            assert gc.get_freeze_count() >= theirs + len(made_after)
        assert gc.get_freeze_count() == 0
        del made_after
    finally:
        gc.unfreeze()


def test_a_cycle_dropped_after_the_loop_is_collected():
    with heap.frozen_after_compile() as freeze:
        node = _Node()
        freeze()
    cycle = weakref.ref(node)
    del node
    gc.collect()
    assert cycle() is None


def test_nothing_is_frozen_when_the_loop_fails_before_the_first_step():
    before = gc.get_freeze_count()
    try:
        with heap.frozen_after_compile():
            raise RuntimeError("stopped")
    except RuntimeError:
        pass
    assert gc.get_freeze_count() == before
