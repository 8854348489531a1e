"""bench/hlo_liveness.py, which BENCHMARKS.md's live-buffer counts come from: checked on a hand-made
scheduled HLO whose live bytes are counted by hand."""

import pytest
from scripts import load_script

liveness = load_script("bench/hlo_liveness.py", "bench_liveness")

# Schedule: 0 p, 1 a, 2 b, 3-4 its elements, 5 c, 6-7 an async permute of c, 8 d, 9 the root.
# Live bytes: a 4096 from 1 to 8; b's elements 2048 (to 8) and 8192 (to 5); c 16384 (5 to 6);
# the permute's result 16384 (6 to 8, read through its done); d 4. Peak at 6: a + b#0 + c + the
# permute's result = 38912 (its operand is c, not a buffer of its own).
HLO = """HloModule step, is_scheduled=true

FileNames
1 "/work/hax_jax/layers/conv.py"
FunctionNames
1 "causal_conv1d"
FileLocations
1 {file_name_id=1 function_name_id=1 line=108 end_line=108 column=4 end_column=9}
StackFrames
1 {file_location_id=1 parent_frame_id=0}

ENTRY %main (p: f32[256]) -> (f32[]) {
  %p = f32[256]{0} parameter(0)
  %a = f32[1024]{0} fusion(%p), kind=kLoop, calls=%f, metadata={op_name="jit(s)/a" stack_frame_id=1}
  %b = (f32[512]{0}, f32[2048]{0}) fusion(%a), kind=kInput, calls=%g, metadata={op_name="jit(s)/b"}
  %b0 = f32[512]{0} get-tuple-element(%b), index=0
  %b1 = f32[2048]{0} get-tuple-element(%b), index=1
  %c = f32[4096]{0} fusion(%b1), kind=kLoop, calls=%h, metadata={op_name="jit(s)/c"}
  %cp-start = ((f32[4096]{0}), f32[4096]{0}) collective-permute-start(%c), channel_id=1
  %cp-done = f32[4096]{0} collective-permute-done(%cp-start)
  %d = f32[] fusion(%cp-done, %a, %b0), kind=kLoop, calls=%k, metadata={op_name="jit(s)/d"}
  ROOT %t = (f32[]) tuple(%d)
}
"""


def test_the_peak_and_what_is_live_there_are_counted_by_hand():
    instructions = liveness.entry_instructions(HLO)
    assert [i.name for i in instructions][:3] == ["p", "a", "b"]
    size, made, last = liveness.buffers(instructions)
    assert size == {
        "a#0": 4096,
        "b#0": 2048,
        "b#1": 8192,
        "c#0": 16384,
        "cp-start#0": 16384,
        "d#0": 4,
    }
    assert last == {"a#0": 8, "b#0": 8, "b#1": 5, "c#0": 6, "cp-start#0": 8, "d#0": 9}
    best, at, live = liveness.peak(size, made, last)
    assert (best, at) == (38912, 6)
    assert sorted(live) == ["a#0", "b#0", "c#0", "cp-start#0"]


def test_the_report_names_our_source_lines(tmp_path, capsys):
    (tmp_path / "step.hlo.txt").write_text(HLO)
    liveness.report(str(tmp_path / "step.hlo.txt"), top=5)
    out = capsys.readouterr().out
    assert "at instruction 6 of 10" in out
    per_source = out.split("live bytes per source line:")[1]
    # a (frame 1, our conv line), b#0, c, the permute's result (no metadata); d comes after.
    for source in ("hax_jax/layers/conv.py:108:causal_conv1d", "op:b", "op:c", "?"):
        assert source in per_source
    assert "op:d" not in out


def test_a_file_without_an_entry_computation_is_refused(tmp_path, monkeypatch):
    (tmp_path / "x.txt").write_text("HloModule nothing\n")
    monkeypatch.setattr("sys.argv", ["hlo_liveness.py", str(tmp_path / "x.txt")])
    with pytest.raises(SystemExit, match="has no ENTRY computation"):
        liveness.main()
