"""bench/decode_ops.py's count of a decode loop's ops: on a hand-made HLO whose ops are counted by
hand, and on compiled loops that differ by one known op."""

import jax
import jax.numpy as jnp
from scripts import load_script

decode_ops = load_script("bench/decode_ops.py", "bench_decode_ops")

# Two loops: the larger body (5 ops: two fusions, one of them with a tuple result, a dot, a sort,
# a copy; parameter, tuple and get-tuple-element launch nothing) is counted; the small one has 1.
HLO = """HloModule decode

%small_body (p: (s32[])) -> (s32[]) {
  %p = (s32[]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] fusion(%i), kind=kLoop, calls=%f0
  ROOT %t = (s32[]) tuple(%n)
}

%big_body (p: (s32[], f32[4,4])) -> (s32[], f32[4,4]) {
  %p = (s32[], f32[4,4]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[4,4] get-tuple-element(%p), index=1
  %n = s32[] fusion(%i), kind=kLoop, calls=%f0
  %m = (f32[4,4], f32[4]) fusion(%x), kind=kLoop, calls=%f1
  %d = f32[4,4] dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %s = f32[4,4] sort(%d), dimensions={1}, to_apply=%lt
  %c = f32[4,4]{0,1} copy(%s)
  ROOT %t = (s32[], f32[4,4]) tuple(%n, %c)
}

ENTRY %main (a: s32[], b: f32[4,4]) -> (s32[], f32[4,4]) {
  %a = s32[] parameter(0)
  %w0 = (s32[]) while(%a), condition=%c0, body=%small_body
  %w1 = (s32[], f32[4,4]) while(%a, %b), condition=%c1, body=%big_body
  ROOT %r = (s32[], f32[4,4]) tuple(%a, %b)
}
"""


def test_the_largest_loop_body_is_counted_without_the_ops_that_launch_nothing():
    assert decode_ops.loop_body_ops(HLO) == {"fusion": 2, "dot": 1, "sort": 1, "copy": 1}


def test_the_loop_bodys_copies_are_named_by_shape_without_layout():
    assert decode_ops.loop_body_copies(HLO) == {"f32[4,4]": 1}


def _loop_ops(sorts: int):
    def body(_, x):
        for _ in range(sorts):
            x = jnp.sort(x @ x, axis=1)
        return x

    run = jax.jit(lambda x: jax.lax.fori_loop(0, 3, body, x))
    return decode_ops.loop_body_ops(run.lower(jnp.ones((8, 8))).compile().as_text())


def test_a_compiled_loop_with_one_more_sort_counts_one_more():
    one, two = _loop_ops(1), _loop_ops(2)
    assert two["sort"] == one["sort"] + 1 >= 2
