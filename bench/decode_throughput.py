"""Generation speed: hax_jax.generate for Mamba-2 130M and 2.7B and HAX-Mamba-2 130M, beside
transformers' generate (mamba_ssm's: bench/decode_mamba_ssm.py).

    python bench/decode_throughput.py [--batches 1,64] [--prompt 2048] [--new 128] [--peer]
        [--params bfloat16|float32] [--set KEY=VALUE ...] [--profile N] [--hlo-dir DIR]
        [--timeline KERNEL]

Random models computing in bf16 (the speed does not depend on the weights), their floating
parameters stored in bf16 as mamba_ssm's peer's are (--params float32: as trained, fp32 parameters
cast inside the program; rows before 2026-11-28 ran that way; --set model.KEY=VALUE changes our
models' configs), random prompts of --prompt tokens, greedy decoding of exactly --new tokens (no
stop token). For each batch size it times the prefill alone (max_new_tokens=1) and the whole
call, each the best of --repeats (taken in turn) after a compiling call, and reports
  decode tokens/s = batch * (new - 1) / (whole - prefill)   (the recurrent steps alone)
  overall tokens/s = batch * new / whole                   (the Mamba paper's throughput: prefill
  included)
With --peer, transformers' Mamba2ForCausalLM (same architecture, bf16, cached generate, greedy,
min_new_tokens = max_new_tokens) is timed the same way in the same process; what it runs
(CUDA/Triton kernels or pure torch) depends on what is installed, and the output says which.

--profile N (GPU) also traces our prefill-only and whole calls and prints, per (model, batch), the
kernel time a decoded token costs against its wall time (kernels that generate's concurrent CUDA
graphs run at once each count whole, so the sum may pass the wall time; below it, the rest is
launch and host time) and the N kernels that cost most a token (the whole call's kernel time less
the prefill's, over new - 1 tokens); --hlo-dir writes each decode program's optimized HLO
(`<model>_b<batch>.hlo.txt`), which names those kernels (XLA's fusions by their HLO name).

--timeline KERNEL (GPU): a traced generate call's (32 new tokens) middle decode step (span, busy,
kernel sum) and its middle layer's kernels by start; KERNEL begins the name of a kernel run once a
layer and token (`_select_kernel` in HAX). Traced steps run slower: read order and overlap.
"""

import argparse
import dataclasses
import importlib
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import timing  # noqa: E402
from hax_jax.config import apply_overrides, load_config_file  # noqa: E402
from hax_jax.generate import generate  # noqa: E402
from hax_jax.models.lm import LanguageModel  # noqa: E402

# the module (hax_jax.generate is also the function's name in the package)
generation = importlib.import_module("hax_jax.generate")

MODELS = {
    "mamba2_130m": "configs/released.py:mamba2_130m",
    "hax_mamba2_130m": "configs/hax_130m.py",
    "mamba2_2_7b": "configs/released.py:mamba2_2_7b",
}


def best_times(fns, repeats: int) -> list[float]:
    """Seconds of the fastest of `repeats` calls of each fn (each blocks until its result is on the
    host), the fns taken in turn within a repeat: a drift of the machine's speed (clocks, another
    process) reaches them alike, so the difference of their times keeps less of it."""
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, seconds in zip(fns, times):
            start = time.perf_counter()
            fn()
            seconds.append(time.perf_counter() - start)
    return [min(seconds) for seconds in times]


def model_config(name: str, overrides=()):
    """Model `name`'s config, `overrides` ("model.key=value") applied (a bad one: ValueError)."""
    return apply_overrides(load_config_file(ROOT / MODELS[name]), overrides).model


def random_model(cfg, params: str = "bfloat16") -> LanguageModel:
    """A model of `cfg`, random weights, computing in bf16, floating parameters in `params`."""
    cfg = dataclasses.replace(cfg, dtype="bfloat16")
    model = LanguageModel(cfg, rngs=nnx.Rngs(0))
    if params != "float32":  # as a model is served: floating parameters stored in bf16
        cast = lambda x: x.astype(params) if jnp.issubdtype(x.dtype, jnp.floating) else x  # noqa: E731
        nnx.update(model, jax.tree.map(cast, nnx.state(model, nnx.Param)))
    return model


def decode_program_text(model, tokens) -> str:
    """The optimized HLO of the decode program generate compiles for `model` and `tokens`."""
    compiled, program = [], generation._decode_program

    def recording(*args, **kwargs):
        decode = program()
        compiled.append(decode.lower(*args, **kwargs).compile().as_text())
        return decode(*args, **kwargs)

    generation._decode_program = lambda: recording
    try:
        generate(model, tokens, 2)
    finally:
        generation._decode_program = program
    return compiled[-1]


def random_prompts(model, batch: int, prompt: int) -> np.ndarray:
    """(batch, prompt) random token ids of the model's vocabulary (no pad id 0)."""
    return np.random.default_rng(0).integers(1, model.cfg.vocab_size, (batch, prompt))


def ours(name: str, model, tokens, new: int, repeats: int, params="bfloat16") -> dict:
    """hax_jax.generate of `model` (random_model, `params`) from the prompts `tokens`."""
    runs = {n: (lambda n=n: generate(model, tokens, n)) for n in (1, new)}
    for run in runs.values():
        run()  # compile
    prefill, whole = best_times([runs[1], runs[new]], repeats)
    batch, prompt = tokens.shape
    return {**rates("hax_jax", name, batch, prompt, new, prefill, whole), "params": params}


def decode_profile(name, model, tokens, new, top: int, hlo_dir: Path | None) -> dict:
    """Kernel time a decoded token costs (the whole call's less the prefill's, over new - 1 tokens),
    with the `top` costliest kernels; the decode program's HLO written to hlo_dir."""
    batch = tokens.shape[0]
    if hlo_dir:
        (hlo_dir / f"{name}_b{batch}.hlo.txt").write_text(decode_program_text(model, tokens))
    prefill, whole = (
        timing.kernel_times_us(lambda n=n: generate(model, tokens, n), reps=3) for n in (1, new)
    )
    per_token = {k: (us - prefill.get(k, 0.0)) / (new - 1) for k, us in whole.items()}
    ranked = sorted(per_token.items(), key=lambda kv: -kv[1])[:top]
    return {
        "model": name,
        "batch": batch,
        "kernel_us_per_token": round(sum(per_token.values()), 1),
        "top_kernels_us_per_token": {k[:100]: round(us, 2) for k, us in ranked},
    }


def peer(batch: int, prompt: int, new: int, repeats: int) -> dict:
    """transformers' Mamba2ForCausalLM.generate, the same architecture as mamba2_130m."""
    import torch
    import transformers
    from transformers.models.mamba2 import modeling_mamba2

    cfg = load_config_file(ROOT / MODELS["mamba2_130m"]).model
    hf = transformers.Mamba2Config(
        hidden_size=cfg.d_model,
        num_hidden_layers=cfg.n_layer,
        state_size=cfg.mamba2.d_state,
        head_dim=cfg.mamba2.headdim,
        num_heads=cfg.d_model * cfg.mamba2.expand // cfg.mamba2.headdim,
        expand=cfg.mamba2.expand,
        n_groups=cfg.mamba2.ngroups,
        vocab_size=cfg.padded_vocab_size,
        chunk_size=cfg.mamba2.chunk_size,
        tie_word_embeddings=True,
    )
    model = transformers.Mamba2ForCausalLM(hf).to("cuda", torch.bfloat16).eval()
    tokens = torch.randint(1, cfg.vocab_size, (batch, prompt), device="cuda")

    def run(n: int):
        with torch.no_grad():
            model.generate(
                tokens, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
            )
        torch.cuda.synchronize()

    run(new)  # warm up
    prefill, whole = best_times([lambda: run(1), lambda: run(new)], repeats)
    fast = getattr(modeling_mamba2, "is_fast_path_available", None)
    out = rates("transformers", "mamba2_130m", batch, prompt, new, prefill, whole)
    return {**out, "kernels": "mamba_ssm/causal_conv1d" if fast else "pure torch"}


def rates(impl, name, batch, prompt, new, prefill, whole) -> dict:
    """The measured times and the derived rates."""
    return {
        "impl": impl,
        "model": name,
        "batch": batch,
        "prompt": prompt,
        "new": new,
        "prefill_s": round(prefill, 4),
        "whole_s": round(whole, 4),
        "decode_tokens_per_s": round(batch * (new - 1) / max(whole - prefill, 1e-9), 1),
        "overall_tokens_per_s": round(batch * new / whole, 1),
    }


def main() -> None:
    """Runs every (model, batch) and prints one JSON line each; --write saves them all."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--params", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--set", nargs="*", default=[], help="config overrides for our models")
    parser.add_argument("--peer", action="store_true")
    parser.add_argument("--write", default="")
    parser.add_argument("--profile", type=int, default=0, help="list this many top GPU kernels")
    parser.add_argument("--hlo-dir", type=Path, help="write each decode program's HLO here")
    parser.add_argument("--timeline", metavar="KERNEL", help="one layer's kernels in a step")
    args = parser.parse_args()
    names = timing.known_names(parser, "--models", args.models.split(","), MODELS)
    timing.check_sizes(parser, args, zero_ok=("profile",))
    if args.hlo_dir:
        timing.make_dir(parser, "--hlo-dir", args.hlo_dir)
    batches = timing.ascending_ints(args.batches, "--batches")
    try:  # a bad --set named before anything compiles
        configs = {name: model_config(name, args.set) for name in names}
    except ValueError as err:
        parser.error(f"--set: {err}")
    print(json.dumps({"device": str(jax.devices()[0].device_kind), "jax": jax.__version__}))
    results = []
    for batch in batches:
        for name in names:
            model = random_model(configs[name], args.params)
            tokens = random_prompts(model, batch, args.prompt)
            results.append(ours(name, model, tokens, args.new, args.repeats, args.params))
            print(json.dumps(results[-1]), flush=True)
            if args.profile or args.hlo_dir:
                profile = decode_profile(name, model, tokens, args.new, args.profile, args.hlo_dir)
                print(json.dumps(profile), flush=True)
            if args.timeline:
                data = timing.trace(lambda m=model, t=tokens: generate(m, t, 32), reps=1)
                try:  # the kernels' names are known only once traced
                    label = f"{name} b{batch}"
                    timing.print_layer_timeline(data, args.timeline, model.cfg.n_layer, label)
                except ValueError as err:
                    parser.error(f"--timeline {args.timeline}: {err}")
            del model  # a 2.7B model's weights freed before the next one's
        if args.peer:
            try:
                results.append(peer(batch, args.prompt, args.new, args.repeats))
            except RuntimeError as err:  # torch.OutOfMemoryError is one
                results.append({"impl": "transformers", "batch": batch, "error": str(err)[:200]})
            print(json.dumps(results[-1]), flush=True)
        if args.write:  # after every batch size: a later failure keeps what was measured
            Path(args.write).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
