"""Ops a decode step runs per layer: the instructions of the body of hax_jax.generate's decode loop
(its while loop) in XLA's optimized HLO, by model, as a model of two layers minus one of one.

    python bench/decode_ops.py [--models mamba2_130m,hax_mamba2_130m] [--batch 1] [--prompt 64]

Each such op (a fusion, a dot, a sort, a gather) is a kernel launch a token on a GPU, which is most
of a small-batch decode step's time: the count says how far a mixer's step is from another's without
timing either. The HLO is the current backend's own (a GPU's fuses differently from a CPU's), so
counts compare only within one backend; prints one JSON line per model, with the opcodes' counts.
"""

import argparse
import collections
import dataclasses
import importlib
import json
import re
import sys
from pathlib import Path

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode_throughput import MODELS, ROOT
from bench.hlo_liveness import ALIASES, INSTRUCTION
from hax_jax.config import load_config_file
from hax_jax.models.lm import LanguageModel

# the module (hax_jax.generate is also the function's name in the package)
generation = importlib.import_module("hax_jax.generate")


def loop_body_ops(hlo: str) -> collections.Counter:
    """Opcode counts of the largest while-loop body in an optimized HLO module's text."""
    bodies = []
    for name in re.findall(r"body=%?([\w.\-]+)", hlo):
        start = hlo.index(f"%{name} ")
        bodies.append(hlo[start : hlo.index("\n}\n", start)])
    if not bodies:
        raise ValueError("the decode program has no while loop")
    ops = collections.Counter()
    for line in max(bodies, key=len).splitlines()[1:]:
        found = INSTRUCTION.match(line)
        if found and found[3] not in ALIASES:  # aliases launch no kernel of their own
            ops[found[3]] += 1
    return ops


def decode_ops(name: str, n_layer: int, batch: int, prompt: int) -> collections.Counter:
    """The decode loop body's ops of model `name` with n_layer layers (random bf16 weights)."""
    cfg = load_config_file(ROOT / MODELS[name]).model
    cfg = dataclasses.replace(cfg, dtype="bfloat16", n_layer=n_layer)
    model = LanguageModel(cfg, rngs=nnx.Rngs(0))
    tokens = np.random.default_rng(0).integers(1, cfg.vocab_size, (batch, prompt))
    compiled, decode = [], generation._decode

    def recording(*args, **kwargs):
        compiled.append(decode.lower(*args, **kwargs).compile().as_text())
        return decode(*args, **kwargs)

    generation._decode = recording
    try:
        generation.generate(model, tokens, 2)
    finally:
        generation._decode = decode
    return loop_body_ops(compiled[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mamba2_130m,hax_mamba2_130m")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=64)
    args = parser.parse_args()
    unknown = sorted(set(args.models.split(",")) - set(MODELS))
    if unknown:
        sys.exit(f"error: unknown --models {','.join(unknown)}; known: {','.join(MODELS)}")
    for flag, value in (("--batch", args.batch), ("--prompt", args.prompt)):
        if value < 1:
            sys.exit(f"error: {flag} must be at least 1, got {value}")
    print(json.dumps({"device": str(jax.devices()[0].device_kind), "jax": jax.__version__}))
    for name in args.models.split(","):
        one, two = (decode_ops(name, n, args.batch, args.prompt) for n in (1, 2))
        per_layer = {op: two[op] - one[op] for op in sorted(two | one) if two[op] != one[op]}
        row = {"model": name, "batch": args.batch, "ops_per_layer": sum(per_layer.values())}
        print(
            json.dumps(
                {
                    **row,
                    "outside_layers": sum(one.values()) - row["ops_per_layer"],
                    "by_opcode": per_layer,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
