"""bench/hlo_collectives.py, which lists a step's collectives by source line and recompute: checked
on a hand-made HLO whose collectives are counted by hand."""

import re

import pytest
from scripts import load_script

collectives = load_script("bench/hlo_collectives.py", "bench_collectives")

# Frame 1 is hax_attention.py:58 (ranking_loss); frame 2 a library file with no line of ours.
HLO = """HloModule step, is_scheduled=true

FileNames
1 "/work/hax_jax/layers/hax_attention.py"
2 "/site-packages/jax/_src/lax/lax.py"
FunctionNames
1 "ranking_loss"
2 "reduce"
FileLocations
1 {file_name_id=1 function_name_id=1 line=58 end_line=58 column=4 end_column=9}
2 {file_name_id=2 function_name_id=2 line=9 end_line=9 column=4 end_column=9}
StackFrames
1 {file_location_id=1 parent_frame_id=0}
2 {file_location_id=2 parent_frame_id=0}

ENTRY %main (p: f32[1,32]) -> (f32[1,32]) {
  %p = f32[1,32]{1,0} parameter(0)
  %ar.1 = f32[1,32]{1,0} all-reduce(%p), channel_id=1, to_apply=%add, metadata={op_name="jit(s)/jvp(jit(take_along_axis))/gather" stack_frame_id=1}
  %ar-start = f32[1,32]{1,0} all-reduce-start(%ar.1), channel_id=2, to_apply=%add, metadata={op_name="jit(s)/transpose(jvp())/checkpoint/rematted_computation/gather" stack_frame_id=1}
  %ar-done = f32[1,32]{1,0} all-reduce-done(%ar-start)
  %ag-start = ((f32[1,32]{1,0}), f32[2,32]{1,0}) all-gather-start(%ar-done), channel_id=3, dimensions={0}, metadata={op_name="jit(s)/transpose(jvp())/checkpoint/rematted_computation/top_k" stack_frame_id=2}
  %ag-done = f32[2,32]{1,0} all-gather-done(%ag-start)
  ROOT %t = (f32[2,32]) tuple(%ag-done)
}
"""  # noqa: E501 (HLO lines as XLA writes them)


def test_collectives_are_grouped_by_source_and_recompute(tmp_path):
    path = tmp_path / "step.hlo.txt"
    path.write_text(HLO)
    groups = collectives.collectives(HLO, collectives.hlo_sources(str(path)))
    source = "hax_jax/layers/hax_attention.py:58:ranking_loss"
    assert groups == {
        collectives.Group("all-reduce", False, source): [1, 128],
        collectives.Group("all-reduce", True, source): [1, 128],
        collectives.Group("all-gather", True, "op:top_k"): [1, 256],  # the result, not operands
    }


def test_an_unreadable_file_is_one_error_line(tmp_path):
    missing = tmp_path / "missing.txt"
    with pytest.raises(SystemExit, match=f"^error: cannot read {re.escape(str(missing))}: "):
        collectives.report(str(missing))
