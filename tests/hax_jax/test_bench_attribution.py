"""bench/kernel_attribution.py, which BENCHMARKS.md's per-source-line comparisons come from: checked
on a hand-made optimized HLO and kernel list whose answer is read off by hand."""

import pytest
from scripts import load_script

attribution = load_script("bench/kernel_attribution.py", "bench_attribution")

# Frame 2 (inside jax) is called from frame 1 (our conv line); fusion.2 has no frame at all.
HLO = """HloModule step

FileNames
1 "/work/hax_jax/layers/conv.py"
2 "/site-packages/jax/_src/numpy.py"
FunctionNames
1 "causal_conv1d"
2 "multiply"
FileLocations
1 {file_name_id=1 function_name_id=1 line=108 end_line=108 column=4 end_column=9}
2 {file_name_id=2 function_name_id=2 line=77 end_line=77 column=2 end_column=8}
StackFrames
1 {file_location_id=1 parent_frame_id=0}
2 {file_location_id=2 parent_frame_id=1}

ENTRY %main (p: f32[4]) -> f32[4] {
  %loop_multiply_fusion.1 = f32[4]{0} fusion(%p), metadata={op_name="jit(s)/mul" stack_frame_id=2}
  ROOT %loop_add_fusion.2 = f32[4]{0} fusion(%p), metadata={op_name="jit(s)/jvp()/add"}
}
"""
LOG = """timeline of case on GPU:0, ms a step: span 4.00, compute 4.00, idle 0.00
     0.100 ms idle  after a  before b
     2.500 ms  loop_multiply_fusion_1
     1.000 ms  loop_add_fusion_2
     0.500 ms  lsh_fwd_kernel
"""


@pytest.fixture
def step(tmp_path):
    (tmp_path / "step.hlo.txt").write_text(HLO)
    (tmp_path / "step.log").write_text(LOG)
    return str(tmp_path / "step.hlo.txt"), str(tmp_path / "step.log")


def test_kernels_go_to_our_innermost_line_or_their_primitive(step):
    assert attribution.by_source(*step) == {
        "hax_jax/layers/conv.py:108:causal_conv1d": 2.5,
        "op:add": 1.0,
        "kernel:lsh_fwd_kernel": 0.5,
    }


def test_the_kernels_of_one_line_are_listed(step):
    assert attribution.kernels_of_line(*step, "conv.py:108") == [
        (2.5, "loop_multiply_fusion_1", "hax_jax/layers/conv.py:108:causal_conv1d")
    ]
    assert attribution.kernels_of_line(*step, "conv.py:109") == []


def test_a_log_without_kernels_is_refused(step, tmp_path):
    (tmp_path / "empty.log").write_text("timeline only\n")
    with pytest.raises(SystemExit, match=r"empty.log lists no kernels"):
        attribution.by_source(step[0], str(tmp_path / "empty.log"))
