"""mamba_ssm's kernels and modules loaded from a checkout, for measurement only: nothing of it is
vendored.

Prepare the checkout once on this machine (it is git-ignored and carried to the GPU machine):

    git -C MAMBA archive HEAD mamba_ssm/ops mamba_ssm/utils mamba_ssm/modules mamba_ssm/distributed
        mamba_ssm/models csrc/selective_scan | tar -x -C .peer
    git -C CONV archive HEAD causal_conv1d csrc | tar -x -C .peer/cc    (whole-model peer only)

MAMBA being a clone of state-spaces/mamba (e9594ce was used), CONV one of Dao-AILab/causal-conv1d
(0d2252d). The Triton SSD needs torch + triton; the CUDA selective scan is compiled there with
torch's cpp_extension (sm_90, about two minutes) into --build-dir; causal-conv1d's extension is
loaded from ../shared/peer's gzipped build for the GPU machines' torch.
"""

import glob
import importlib
import importlib.util
import os
import sys
import types


def register_packages(peer_dir):
    """Register mamba_ssm's packages without running mamba_ssm/__init__ (which imports the
    compiled extension and the model code)."""
    for name, sub in (
        ("mamba_ssm", ""),
        ("mamba_ssm.ops", "ops"),
        ("mamba_ssm.ops.triton", "ops/triton"),
        ("mamba_ssm.utils", "utils"),
        ("mamba_ssm.modules", "modules"),
        ("mamba_ssm.distributed", "distributed"),
        ("mamba_ssm.models", "models"),
    ):
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = [os.path.join(peer_dir, "mamba_ssm", sub)]
            sys.modules[name] = module


def triton_ssd(peer_dir):
    """mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined."""
    register_packages(peer_dir)
    return importlib.import_module("mamba_ssm.ops.triton.ssd_combined").mamba_chunk_scan_combined


def _prebuilt(build_dir):
    """The extension from build_dir/selective_scan_cuda.so(.gz) of an earlier build, or None."""
    import gzip
    import importlib.machinery
    import importlib.util
    import shutil

    import torch  # noqa: F401  (the extension links against torch's libraries)

    path = os.path.join(build_dir, "selective_scan_cuda.so")
    if not os.path.exists(path) and os.path.exists(path + ".gz"):
        with gzip.open(path + ".gz") as src, open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)
    if not os.path.exists(path):
        return None
    loader = importlib.machinery.ExtensionFileLoader("selective_scan_cuda", path)
    spec = importlib.util.spec_from_loader("selective_scan_cuda", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def cuda_selective_scan(peer_dir, build_dir):
    """mamba_ssm's selective_scan_fn over its CUDA kernels, compiled here for sm_90 (or loaded
    from an earlier build's selective_scan_cuda.so[.gz] in build_dir)."""
    load_selective_scan_cuda(peer_dir, build_dir)
    return importlib.import_module("mamba_ssm.ops.selective_scan_interface").selective_scan_fn


def load_selective_scan_cuda(peer_dir, build_dir):
    """The CUDA selective scan extension as `selective_scan_cuda` (what mamba_ssm imports), built
    or loaded as `cuda_selective_scan` says; mamba_ssm's packages registered."""
    if "selective_scan_cuda" not in sys.modules:
        sys.modules["selective_scan_cuda"] = _prebuilt(build_dir) or _build(peer_dir, build_dir)
    register_packages(peer_dir)


def load_causal_conv1d(peer_dir, prebuilt):
    """causal-conv1d's extension from `prebuilt` (a gzipped causal_conv1d_cuda.so built for this
    torch, ../shared/peer) as `causal_conv1d_cuda`, and its python package from peer_dir/cc."""
    import gzip
    import importlib.machinery
    import shutil

    import torch  # noqa: F401  (the extension links against torch's libraries)

    build = os.path.join(peer_dir, "cc_build")
    os.makedirs(build, exist_ok=True)
    path = os.path.join(build, "causal_conv1d_cuda.so")
    with gzip.open(prebuilt) as src, open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    loader = importlib.machinery.ExtensionFileLoader("causal_conv1d_cuda", path)
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    sys.modules["causal_conv1d_cuda"] = module
    sys.path.insert(0, os.path.join(peer_dir, "cc"))
    importlib.import_module("causal_conv1d")


def load_models(peer_dir, causal_conv1d, build_dir, selective_scan: bool):
    """What mamba_ssm's modules and models import: causal-conv1d (`load_causal_conv1d`), with
    selective_scan the CUDA selective scan (Mamba-1's; Mamba-2's fused path needs none), and
    mamba_ssm's packages registered."""
    load_causal_conv1d(peer_dir, causal_conv1d)
    if selective_scan:
        load_selective_scan_cuda(peer_dir, build_dir)
    register_packages(peer_dir)


def _build(peer_dir, build_dir):
    """Compile csrc/selective_scan with torch's cpp_extension (sm_90, mamba_ssm's flags)."""
    from torch.utils.cpp_extension import load

    src = os.path.join(peer_dir, "csrc", "selective_scan")
    os.makedirs(build_dir, exist_ok=True)
    return load(
        name="selective_scan_cuda",
        sources=sorted(
            glob.glob(os.path.join(src, "*.cpp")) + glob.glob(os.path.join(src, "*.cu"))
        ),
        extra_cflags=["-O3", "-std=c++17"],
        extra_cuda_cflags=[
            "-O3",
            "-std=c++17",
            "-U__CUDA_NO_HALF_OPERATORS__",
            "-U__CUDA_NO_HALF_CONVERSIONS__",
            "-U__CUDA_NO_BFLOAT16_OPERATORS__",
            "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
            "-U__CUDA_NO_BFLOAT162_OPERATORS__",
            "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
            "--expt-relaxed-constexpr",
            "--expt-extended-lambda",
            "--use_fast_math",
            "-gencode",
            "arch=compute_90,code=sm_90",
            "--threads",
            "8",
        ],
        extra_include_paths=[src],
        build_directory=build_dir,
        verbose=False,
    )
