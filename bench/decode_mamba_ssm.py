"""The peer of bench/decode_throughput.py: mamba_ssm's own generate with CUDA graphs (issue 20).

    python bench/decode_mamba_ssm.py --models mamba2_130m,mamba2_2_7b --batches 1,64 --peer .peer \
        --causal-conv1d .peer/causal_conv1d_cuda.so.gz [--build-dir .peer/build]

mamba_ssm's MambaLMHeadModel at configs/released.py's sizes with mamba_ssm's defaults otherwise
(random bf16 weights: the speed does not depend on them), and its `generate(..., cg=True)`: the
prompt's forward, then one replay of a captured CUDA graph a token (selective_state_update,
causal_conv1d_update). Greedy (top_k=1) with no stop token, so exactly --new tokens. Timed as
decode_throughput.py times ours, in a process of its own (JAX would hold most of the GPU's memory):
the prefill alone (one new token) and the whole call, each the best of --repeats after a call that
captures the graphs; one JSON line each, decode_throughput.py's fields. Loading the peer (.peer, the
Mamba-1 selective scan's --build-dir): bench/mamba_ssm_peer.py.
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT))

from bench import mamba_ssm_peer, timing  # noqa: E402
from bench.decode_throughput import best_times, rates  # noqa: E402
from bench.train_step_mamba_ssm import (  # noqa: E402
    VOCAB,
    check_args,
    released_sizes,
)


def peer_model(kind: str, d_model: int, n_layer: int, pad: int):
    """mamba_ssm's MambaLMHeadModel of `kind` ("mamba" or "mamba2"), bf16 on the GPU."""
    import torch
    from mamba_ssm.models.config_mamba import MambaConfig
    from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel

    config = MambaConfig(
        d_model=d_model,
        n_layer=n_layer,
        vocab_size=VOCAB,
        ssm_cfg={"layer": "Mamba2" if kind == "mamba2" else "Mamba1"},
        pad_vocab_size_multiple=pad,
    )
    torch.manual_seed(0)
    return MambaLMHeadModel(config, device="cuda", dtype=torch.bfloat16).eval()


def measure(model, name: str, batch: int, prompt: int, new: int, repeats: int) -> dict:
    """generate(cg=True) of `new` tokens after `prompt` random ones, timed as ours."""
    import torch

    tokens = torch.randint(1, VOCAB, (batch, prompt), device="cuda")

    def run(n: int):
        with torch.no_grad():
            out = model.generate(tokens, max_length=prompt + n, top_k=1, cg=True)
        torch.cuda.synchronize()
        if out.shape != (batch, prompt + n):
            raise RuntimeError(f"generate returned {tuple(out.shape)}, not {(batch, prompt + n)}")

    times = {}
    for n in (1, new):  # a new length captures new graphs: the warm-up call takes that; so one
        run(n)  # length's repeats run together, not in turn with the other's
        (times[n],) = best_times([lambda n=n: run(n)], repeats)
    return {**rates("mamba_ssm", name, batch, prompt, new, times[1], times[new]), "cg": True}


def main() -> None:
    sizes, pad = released_sizes()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mamba2_130m,mamba2_2_7b", help=f"of {sorted(sizes)}")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peer", default=".peer", help="mamba_ssm checkout (mamba_ssm_peer.py)")
    parser.add_argument("--build-dir", default=".peer/build", help="the CUDA selective scan's")
    parser.add_argument("--causal-conv1d", required=True, help="gzipped causal_conv1d_cuda.so")
    args = parser.parse_args()
    names = args.models.split(",")
    positive = dict(prompt=args.prompt, new=args.new, repeats=args.repeats)
    check_args(names, sizes, args.peer, args.causal_conv1d, **positive)
    batches = timing.ascending_ints(args.batches, "--batches")

    import torch

    mamba1 = any(sizes[n][0] == "mamba" for n in names)  # its prefill runs the CUDA scan
    mamba_ssm_peer.load_models(args.peer, args.causal_conv1d, args.build_dir, mamba1)
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__}))
    for name in names:
        kind, d_model, n_layer = sizes[name]
        model = peer_model(kind, d_model, n_layer, pad[kind])
        for batch in batches:
            try:
                result = measure(model, name, batch, args.prompt, args.new, args.repeats)
            except torch.cuda.OutOfMemoryError as err:
                result = {"impl": "mamba_ssm", "model": name, "batch": batch, "error": str(err)}
            print(json.dumps(result), flush=True)
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
