"""Ops a decode step runs per layer: the instructions of the body of hax_jax.generate's decode loop
(its while loop) in XLA's optimized HLO, by model, as a model of two layers minus one of one.

    python bench/decode_ops.py [--models mamba2_130m,hax_mamba2_130m] [--batch 1] [--prompt 64]
        [--hlo-dir DIR]

Each such op (a fusion, a dot, a sort, a gather) is a kernel launch a token on a GPU, which is most
of a small-batch decode step's time: the count says how far a mixer's step is from another's without
timing either. The HLO is the current backend's own (a GPU's fuses differently from a CPU's), so
counts compare only within one backend; prints one JSON line per model, with the opcodes' counts and
the copies' shapes (a cache meant to be updated in place but copied costs its whole size a token).
"""

import argparse
import collections
import dataclasses
import json
import re
import sys
from pathlib import Path

import jax
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import timing
from bench.decode_throughput import MODELS, ROOT, decode_program_text, random_prompts
from bench.hlo_liveness import ALIASES, INSTRUCTION
from hax_jax.config import load_config_file
from hax_jax.models.lm import LanguageModel


def _loop_body(hlo: str) -> list[tuple[str, str]]:
    """(opcode, result shape) of each kernel-launching instruction of the largest while-loop body
    in an optimized HLO module's text."""
    bodies = []
    for name in re.findall(r"body=%?([\w.\-]+)", hlo):
        start = hlo.index(f"%{name} ")
        bodies.append(hlo[start : hlo.index("\n}\n", start)])
    if not bodies:
        raise ValueError("the decode program has no while loop")
    found = (INSTRUCTION.match(line) for line in max(bodies, key=len).splitlines()[1:])
    # aliases launch no kernel of their own
    return [(m[3], m[2]) for m in found if m and m[3] not in ALIASES]


def loop_body_ops(hlo: str) -> collections.Counter:
    """Opcode counts of the largest while-loop body in an optimized HLO module's text."""
    return collections.Counter(op for op, _ in _loop_body(hlo))


def loop_body_copies(hlo: str) -> collections.Counter:
    """The result shapes of that body's copies (a buffer the step rewrites copied every token,
    where an in-place update was meant), counted by shape."""
    return collections.Counter(
        re.sub(r"\{[^}]*\}", "", shape) for op, shape in _loop_body(hlo) if op == "copy"
    )


def decode_hlo(name: str, n_layer: int, batch: int, prompt: int) -> str:
    """The optimized HLO of generate's decode program for model `name` with n_layer layers (random
    weights, bf16 compute)."""
    cfg = load_config_file(ROOT / MODELS[name]).model
    cfg = dataclasses.replace(cfg, dtype="bfloat16", n_layer=n_layer)
    model = LanguageModel(cfg, rngs=nnx.Rngs(0))
    return decode_program_text(model, random_prompts(model, batch, prompt))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mamba2_130m,hax_mamba2_130m")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--hlo-dir", type=Path, help="also write each decode program's HLO here")
    args = parser.parse_args()
    names = timing.known_names(parser, "--models", args.models.split(","), MODELS)
    timing.check_sizes(parser, args)
    if args.hlo_dir:
        timing.make_dir(parser, "--hlo-dir", args.hlo_dir)
    print(json.dumps({"device": str(jax.devices()[0].device_kind), "jax": jax.__version__}))
    for name in names:
        one, two = (decode_hlo(name, n, args.batch, args.prompt) for n in (1, 2))
        if args.hlo_dir:
            for n, text in ((1, one), (2, two)):
                (args.hlo_dir / f"{name}_{n}_layers.hlo.txt").write_text(text)
        ops = {n: loop_body_ops(text) for n, text in ((1, one), (2, two))}
        per_layer = {
            op: ops[2][op] - ops[1][op]
            for op in sorted(ops[2] | ops[1])
            if ops[2][op] != ops[1][op]
        }
        copies = loop_body_copies(two) - loop_body_copies(one)
        row = {"model": name, "batch": args.batch, "ops_per_layer": sum(per_layer.values())}
        print(
            json.dumps(
                {
                    **row,
                    "outside_layers": sum(ops[1].values()) - row["ops_per_layer"],
                    "by_opcode": per_layer,
                    "copies_per_layer": dict(sorted(copies.items())),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
