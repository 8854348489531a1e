"""The step, decode, GEMV-layout, sparse-components, longest-row and sparse-attention benches
refuse bad arguments with one error line naming the value, before they compile anything (an unknown
case or model was a KeyError traceback, an unwritable --hlo-dir failed only after the first
compile, longest_sequence.py reported an unknown case as "did not fit", a zero length or a bad
block was a traceback)."""

import os
import runpy
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def run_script(script, args, monkeypatch, capsys):
    """`python bench/<script> ARGS` in this process (a subprocess a case spent ~3 s importing):
    (exit code, stderr). Any exception but SystemExit propagates: the traceback a user would see.
    What a script changes of sys.argv, sys.path and the environment is put back after."""
    monkeypatch.setattr(sys, "argv", [str(BENCH / script), *args])
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("XLA_FLAGS", "TOKENIZERS_PARALLELISM"):  # train_throughput's __main__ sets them
        if name in os.environ:
            monkeypatch.setenv(name, os.environ[name])
        else:
            monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(BENCH / script), run_name="__main__")
    code, err = stop.value.code, capsys.readouterr().err
    if isinstance(code, str):  # the interpreter prints such a code on stderr and exits with 1
        code, err = 1, f"{err}{code}\n"
    return code, err


@pytest.mark.parametrize(
    "script, args, named",
    [
        ("train_throughput.py", ["--cases", "lm_nope"], "unknown --cases lm_nope"),
        ("train_throughput.py", ["--hlo-dir", "{file}/hlo"], "--hlo-dir {file}/hlo"),
        ("decode_ops.py", ["--hlo-dir", "{file}/hlo"], "--hlo-dir {file}/hlo"),
        ("decode_ops.py", ["--batch", "0"], "--batch must be at least 1, got 0"),
        ("decode_throughput.py", ["--models", "nope"], "unknown --models nope"),
        ("decode_throughput.py", ["--batches", "0"], "--batches must be positive"),
        ("decode_throughput.py", ["--params", "fp16"], "--params: invalid choice: 'fp16'"),
        ("decode_throughput.py", ["--profile", "-1"], "--profile must be at least 0, got -1"),
        ("decode_throughput.py", ["--hlo-dir", "{file}/hlo"], "--hlo-dir {file}/hlo"),
        (
            "decode_throughput.py",
            ["--set", "model.mamba2.chunk_size=0"],
            "--set: mamba2.chunk_size must be positive, got 0",
        ),
        ("decode_gemv_layout.py", ["--layers", "0"], "--layers must be at least 1, got 0"),
        ("decode_gemv_layout.py", ["--d-inner", "4096"], "--d-inner 4096 is wider than --in-proj"),
        ("sparse_components.py", ["{file}/run"], "{file}/run"),
        ("sparse_components.py", ["run", "--rows", "0"], "--rows must be at least 1, got 0"),
        ("longest_sequence.py", ["--case", "lm_nope"], "unknown --case lm_nope"),
        ("sparse_attention_scaling.py", ["--lengths", "0"], "--lengths must be at least 1, got 0"),
        ("sparse_attention_scaling.py", ["--max-len", "-1"], "--max-len must be at least 0"),
        (
            "sparse_attention_scaling.py",
            ["--pattern", "sw+nope", "--lengths", "64"],
            "unknown component 'nope' in pattern 'sw+nope'",
        ),
        ("sparse_attention_kernel.py", ["--block-q", "24"], "block_q must be a power of two"),
        (
            "multiprocess_throughput.py",
            ["--case", "lm_mamba2_130m", "--processes", "0"],
            "--processes must be at least 1, got 0",
        ),
        ("multiprocess_throughput.py", ["--case", "lm_nope"], "--case: invalid choice: 'lm_nope'"),
    ],
    ids=[
        "unknown-case",
        "step-hlo-dir-under-a-file",
        "decode-hlo-dir-under-a-file",
        "batch-0",
        "unknown-decode-model",
        "decode-batch-0",
        "decode-params-dtype",
        "decode-profile-negative",
        "decode-hlo-dir-under-a-file",
        "decode-set-bad-value",
        "gemv-layers-0",
        "gemv-inner-wider-than-in-proj",
        "components-no-workdir",
        "components-rows-0",
        "longest-unknown-case",
        "scaling-length-0",
        "scaling-max-len-negative",
        "scaling-unknown-pattern",
        "kernel-block-not-a-power-of-two",
        "processes-0",
        "processes-unknown-case",
    ],
)
def test_bad_arguments_stop_with_one_error_line(tmp_path, monkeypatch, capsys, script, args, named):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    args = [a.format(file=a_file) for a in args]
    code, err = run_script(script, args, monkeypatch, capsys)
    assert code not in (0, None), err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and named.format(file=a_file) in errors[0], err
