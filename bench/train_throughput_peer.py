"""The peer of bench/train_throughput.py's lm_mamba2_130m case: transformers' Mamba2ForCausalLM
training step.

    python bench/train_throughput_peer.py [--steps 10]

The same architecture (mamba2_130m: d_model 768, 24 layers, d_state 128, headdim 64, vocab 50288),
--batch x 2048 random tokens (8 = the case's batch), fp32 parameters with bf16 autocast, AdamW, clip
1.0. Whether transformers runs its CUDA/Triton kernels or its pure-torch path depends on what is
installed; the printed line says which.
"""

import argparse
import time

import torch
import transformers


def main() -> None:
    """Times --steps training steps after two warm-up steps; prints ms/step and tokens/s."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    cfg = transformers.Mamba2Config(
        hidden_size=768,
        num_hidden_layers=24,
        state_size=128,
        head_dim=64,
        num_heads=24,
        expand=2,
        n_groups=1,
        vocab_size=50288,
        chunk_size=256,
        tie_word_embeddings=True,
    )
    model = transformers.Mamba2ForCausalLM(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    tokens = torch.randint(1, 50277, (args.batch, 2048), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    torch.cuda.synchronize()
    ms = 1e3 * (time.perf_counter() - start) / args.steps
    from transformers.models.mamba2 import modeling_mamba2 as m

    fast = getattr(m, "is_fast_path_available", None)
    print(
        f"| hf_mamba2_130m (torch {torch.__version__}, transformers {transformers.__version__}, "
        f"fast path {fast}) | {args.batch} x 2048 | {ms:.2f} ms | "
        f"{args.batch * 2048 / ms * 1e3:,.0f} tokens/s | "
        f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB | loss {loss.item():.3f} |"
    )


if __name__ == "__main__":
    main()
