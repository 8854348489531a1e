"""The peer of the whole-model training step: mamba_ssm's own LM, Mamba-1 or Mamba-2 (issue 20).

    python bench/train_step_mamba_ssm.py --model mamba2_130m --batches 8,16,32 --peer .peer \
        --build-dir .peer/build --causal-conv1d .peer/causal_conv1d_cuda.so.gz [--compile]

(.peer prepared as bench/mamba_ssm_peer.py says, with ../shared/peer/causal_conv1d_cuda.so.gz copied
in: the GPU machines see only the project's folder.)

mamba_ssm's MambaLMHeadModel layout (embedding, n_layer x Block(mixer) with fused add + RMSNorm and
the residual in fp32, final RMSNorm, tied head) over its fused paths: Mamba-1 is
`modules.mamba_simple.Mamba` (mamba_inner_fn: the CUDA selective scan and causal-conv1d), Mamba-2
`modules.mamba2.Mamba2` with use_mem_eff_path (causal-conv1d and the Triton SSD fused). The sizes
are configs/released.py's, with mamba_ssm's defaults (Mamba-1 d_state 16; Mamba-2 d_state 128,
headdim 64) and vocabularies (50277 padded to 8 or 16). As ours (bench/train_throughput.py):
fp32 parameters, bf16 compute (autocast), AdamW (torch's fused), clip 1.0, rows of --seq random
tokens. `--compile` runs the model under torch.compile; `--kernel-time` adds the step's summed CUDA
kernel time (torch.profiler over 3 more steps): far below the step time, the step waits on the host
launching kernels. The batches run in the order given (ascending), each after two warm-up steps,
until one runs out of memory: the last row that ran is the largest batch that fits. Loading the
peer: bench/mamba_ssm_peer.py.
"""

import argparse
import gc
import math
import os
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT))

from bench import mamba_ssm_peer, timing  # noqa: E402
from hax_jax.config import load_config_module  # noqa: E402

VOCAB = 50277


def released_sizes() -> tuple[dict, dict]:
    """configs/released.py's SIZES and vocabulary padding (PAD_VOCAB_MULTIPLE)."""
    released = load_config_module(ROOT / "configs/released.py")
    return released.SIZES, released.PAD_VOCAB_MULTIPLE


def build_lm(kind: str, d_model: int, n_layer: int, vocab: int):
    """mamba_ssm's LM of `kind` ("mamba" or "mamba2") on the GPU, fp32 parameters."""
    import torch
    from mamba_ssm.modules.block import Block
    from mamba_ssm.ops.triton.layer_norm import RMSNorm, layer_norm_fn

    if kind == "mamba":
        from mamba_ssm.modules.mamba_simple import Mamba

        mixer = partial(Mamba, d_state=16, use_fast_path=True)
    else:
        from mamba_ssm.modules.mamba2 import Mamba2

        mixer = partial(Mamba2, d_state=128, headdim=64, use_mem_eff_path=True)

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = torch.nn.Embedding(vocab, d_model)
            self.layers = torch.nn.ModuleList(
                Block(
                    d_model,
                    partial(mixer, layer_idx=i),
                    mlp_cls=torch.nn.Identity,
                    norm_cls=partial(RMSNorm, eps=1e-5),
                    fused_add_norm=True,
                    residual_in_fp32=True,
                )
                for i in range(n_layer)
            )
            self.norm_f = RMSNorm(d_model, eps=1e-5)

        def forward(self, tokens):
            hidden, residual = self.embedding(tokens), None
            for layer in self.layers:
                hidden, residual = layer(hidden, residual)
            hidden = layer_norm_fn(
                hidden,
                self.norm_f.weight,
                self.norm_f.bias,
                eps=1e-5,
                residual=residual,
                prenorm=False,
                residual_in_fp32=True,
                is_rms_norm=True,
            )
            return hidden @ self.embedding.weight.T  # tied head

    torch.manual_seed(0)
    return LM().cuda()


def time_batch(
    model, optimizer, batch: int, seq: int, vocab: int, steps: int, kernel_time: bool = False
) -> dict:
    """ms a step, tokens/s and peak GiB of `steps` steps at `batch` rows, after two warm-ups;
    with kernel_time also the summed CUDA kernel ms of a step."""
    import torch
    import torch.nn.functional as F

    tokens = torch.randint(1, VOCAB, (batch, seq + 1), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        loss = step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / steps
    if not math.isfinite(float(loss)):
        raise FloatingPointError(f"non-finite loss {float(loss)} at batch {batch}")
    out = {
        "step_ms": 1e3 * seconds,
        "tokens_per_s": batch * seq / seconds,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
    }
    if kernel_time:
        out["kernel_ms"] = kernel_ms_a_step(step, 3)
    return out


def kernel_ms_a_step(step, steps: int) -> float:
    """The CUDA kernels' summed time of one step (one stream: their sum is the GPU's busy time)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e3 / steps


def check_args(models: list[str], sizes: dict, peer: str, causal_conv1d: str, **positive) -> None:
    """SystemExit with one error line naming the value unless every model is a released size,
    peer holds a mamba_ssm checkout, the causal-conv1d build exists and `positive` are > 0."""
    unknown = [m for m in models if m not in sizes]
    if unknown:
        raise SystemExit(f"error: unknown models {unknown}; known: {sorted(sizes)}")
    if not os.path.isdir(os.path.join(peer, "mamba_ssm")):
        raise SystemExit(
            f"error: --peer {peer!r} holds no mamba_ssm checkout (bench/mamba_ssm_peer.py says "
            "how to prepare one)"
        )
    if not os.path.isfile(causal_conv1d):
        raise SystemExit(f"error: --causal-conv1d {causal_conv1d!r} is not a file")
    for name, value in positive.items():
        if value < 1:
            raise SystemExit(f"error: --{name} must be positive, got {value}")


def main() -> None:
    sizes, pad = released_sizes()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help=f"one of {sorted(sizes)}")
    parser.add_argument("--batches", default="8", help="rows of --seq tokens, ascending")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--compile", action="store_true", help="the model under torch.compile")
    parser.add_argument("--kernel-time", action="store_true", help="also the summed kernel ms")
    parser.add_argument("--peer", default=".peer", help="mamba_ssm checkout (mamba_ssm_peer.py)")
    parser.add_argument("--build-dir", default=".peer/build", help="the CUDA selective scan's")
    parser.add_argument("--causal-conv1d", required=True, help="gzipped causal_conv1d_cuda.so")
    args = parser.parse_args()
    check_args([args.model], sizes, args.peer, args.causal_conv1d, seq=args.seq, steps=args.steps)
    batches = timing.ascending_ints(args.batches, "--batches")
    kind, d_model, n_layer = sizes[args.model]
    vocab = -(-VOCAB // pad[kind]) * pad[kind]

    import torch

    mamba_ssm_peer.load_models(args.peer, args.causal_conv1d, args.build_dir, kind == "mamba")
    model = build_lm(kind, d_model, n_layer, vocab)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    run = torch.compile(model) if args.compile else model
    print(
        f"\nmamba_ssm {args.model} ({params / 1e6:.0f}M parameters), torch {torch.__version__}, "
        f"{torch.cuda.get_device_name()}{', torch.compile' if args.compile else ''}\n\n"
        "| batch | step ms | tokens/s | peak GiB | kernel ms |\n"
        "| ---: | ---: | ---: | ---: | ---: |",
        flush=True,
    )
    for batch in batches:
        try:
            r = time_batch(run, optimizer, batch, args.seq, vocab, args.steps, args.kernel_time)
        except torch.cuda.OutOfMemoryError:
            print(f"| {batch} x {args.seq} | | | out of memory | |", flush=True)
            break
        kernel = f"{r['kernel_ms']:.2f}" if "kernel_ms" in r else ""
        print(
            f"| {batch} x {args.seq} | {r['step_ms']:.2f} | {r['tokens_per_s']:,.0f} | "
            f"{r['peak_gib']:.1f} | {kernel} |",
            flush=True,
        )
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
