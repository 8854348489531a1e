"""Evaluates a checkpoint: `python eval.py <checkpoint dir> [--tokens 1,2,3]`.

Joint recall, MQAR, RULER-style tasks, perplexity and the lm-evaluation-harness adapter are issue #5.
Until then this loads a hax_jax checkpoint (e.g. one written by `python -m hax_jax.convert`) and prints the
next-token distribution's top entries for the given token ids, which checks a conversion end to end.
"""

import argparse

import jax
import jax.numpy as jnp

from hax_jax import load_pretrained


def main() -> None:
    """Loads the checkpoint and runs the model once."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="a hax_jax checkpoint directory (config.json + params/)")
    parser.add_argument("--tokens", default="1,2,3", help="comma-separated token ids")
    args = parser.parse_args()
    model = load_pretrained(args.checkpoint)
    tokens = jnp.array([[int(t) for t in args.tokens.split(",")]], jnp.int32)
    logits = model(tokens)[0, -1]
    top = jax.lax.top_k(jax.nn.log_softmax(logits), 5)
    print("next-token log-probs:", {int(i): round(float(v), 4) for v, i in zip(*top)})


if __name__ == "__main__":
    main()
