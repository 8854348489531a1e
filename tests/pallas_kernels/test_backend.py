"""pallas_kernels.backend: reading and setting XLA's command-buffer flag."""

import os

import pytest

from pallas_kernels.backend import custom_calls_in_cuda_graphs, keep_custom_calls_out_of_cuda_graphs


@pytest.mark.parametrize(
    "flags, recorded",
    [
        ("", True),  # XLA's default set has CUSTOM_CALL
        ("--xla_dump_to=/tmp/d", True),
        ("--xla_gpu_enable_command_buffer=", False),  # no command buffers
        ("--xla_gpu_enable_command_buffer=-CUSTOM_CALL", False),
        ("--xla_gpu_enable_command_buffer=+WHILE,-CUSTOM_CALL", False),
        ("--xla_gpu_enable_command_buffer=-CUSTOM_CALL,+CUSTOM_CALL", True),
        ("--xla_gpu_enable_command_buffer=+WHILE", True),
        ("--xla_gpu_enable_command_buffer=FUSION,CUBLAS", False),  # a set without it
        ("--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL", True),
        ("-xla_gpu_enable_command_buffer=FUSION", False),
        # flags parse in order: the last occurrence wins
        ("--xla_gpu_enable_command_buffer= --xla_gpu_enable_command_buffer=+WHILE", True),
    ],
)
def test_custom_calls_in_cuda_graphs(flags, recorded):
    assert custom_calls_in_cuda_graphs(flags) is recorded


def test_keep_custom_calls_out_adds_the_flag_once(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/d")
    keep_custom_calls_out_of_cuda_graphs()
    keep_custom_calls_out_of_cuda_graphs()
    flags = "--xla_dump_to=/tmp/d --xla_gpu_enable_command_buffer=-CUSTOM_CALL"
    assert os.environ["XLA_FLAGS"] == flags
    assert not custom_calls_in_cuda_graphs()


def test_keep_custom_calls_out_respects_the_users_flag(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL")
    keep_custom_calls_out_of_cuda_graphs()
    assert os.environ["XLA_FLAGS"] == "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL"
    assert custom_calls_in_cuda_graphs()
    monkeypatch.delenv("XLA_FLAGS")
    keep_custom_calls_out_of_cuda_graphs()
    assert os.environ["XLA_FLAGS"] == "--xla_gpu_enable_command_buffer=-CUSTOM_CALL"
