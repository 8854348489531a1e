"""What each component of a trained model's sparse pattern does (HAX = lsh+ks): the keys each
selects per query, the keys only it selects, the union softmax's mass on those, and the held-out
accuracy with the component removed from the pattern (the same weights).

    python bench/sparse_components.py WORKDIR [--examples 256] [--rows 8]

WORKDIR is a training workdir of the joint-recall or MQAR task whose model has a sparse branch
(e.g. results/joint_recall/mamba2,hax-s0). Per layer (JSON lines), from the first --rows test
examples: mean keys a query selects by component, the keys only that component selects, and the
softmax mass on them, over the second half of each row (where every component has keys to choose).
Then the test accuracy and loss over the first --examples test examples, for the pattern as trained
and for the pattern less each component (a model without it, the same parameters, each remaining
component keeping its keys a query; a component's own parameters, the key scorer's, are left
unused).
"""

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import timing
from hax_jax import checkpoint, training
from hax_jax.data import pipeline
from hax_jax.layers import hax_attention
from pallas_kernels.sparse_attention.indexed import selected_indices


def branch_inputs(model, tokens) -> list[tuple]:
    """(spec, q, k, hash_proj, key_scores) of each layer's sparse branch on `tokens`, eval mode."""
    seen, attend = [], hax_attention.HaxBranch._attend

    def recording(self, q, k, x, hash_proj, scores):
        seen.append((self.spec, q, k, hash_proj, scores))
        return attend(self, q, k, x, hash_proj, scores)

    hax_attention.HaxBranch._attend = recording
    try:
        model(jnp.asarray(tokens))
    finally:
        hax_attention.HaxBranch._attend = attend
    return seen


def selection_stats(spec, q, k, hash_proj, scores) -> dict:
    """Per component: keys a query selects, keys only it selects, the union softmax's mass on
    those; means over the second half of the rows."""
    j, valid = (
        np.asarray(a)
        for a in selected_indices(q, k, spec=spec, hash_proj=hash_proj, key_scores=scores)
    )
    kc, names = spec.keys_per_component, spec.components
    comp = np.repeat(np.arange(len(names)), kc)  # each slot's component
    same = (j[..., :, None] == j[..., None, :]) & valid[..., None, :] & valid[..., :, None]
    elsewhere = (same & (comp[:, None] != comp[None, :])).any(-1)
    first = valid & ~np.tril(same, -1).any(-1)  # a key two slots hold counts once
    keys = np.asarray(k, np.float32)[np.arange(len(j))[:, None, None], j]  # (b, l, slots, n)
    logits = np.einsum("bin,bisn->bis", np.asarray(q, np.float32), keys)
    logits = np.where(first, logits, -np.inf)
    top = np.max(logits, -1, keepdims=True)
    weights = np.where(first, np.exp(logits - np.where(np.isfinite(top), top, 0.0)), 0.0)
    p = weights / np.maximum(weights.sum(-1, keepdims=True), 1e-30)
    late = slice(q.shape[1] // 2, None)
    out = {}
    for c, name in enumerate(names):
        mine = comp == c
        only = valid & mine & ~elsewhere
        out[name] = {
            "keys": float(valid[:, late][..., mine].sum(-1).mean()),
            "only_keys": float(only[:, late].sum(-1).mean()),
            "mass_on_only": float((p * (only & first))[:, late].sum(-1).mean()),
        }
    return out


def narrowed(sparse, pattern: str):
    """The sparse config `sparse` with `pattern` (some of its components), each component keeping
    its keys a query (num_keys is shared among the components)."""
    kc = sparse.spec.keys_per_component
    return dataclasses.replace(sparse, pattern=pattern, num_keys=kc * len(pattern.split("+")))


def accuracy(model, cfg, pattern: str, batches: list) -> dict:
    """Test accuracy and loss of `model`'s parameters in a model whose pattern is `pattern`."""
    model_cfg = dataclasses.replace(cfg.model, sparse=narrowed(cfg.model.sparse, pattern))
    trained = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    graphdef, state = nnx.split(checkpoint.abstract_model(model_cfg), nnx.Param)

    def take(target, source):  # the target's leaves, from the trained tree
        return {
            k: take(v, source[k]) if isinstance(v, dict) else source[k] for k, v in target.items()
        }

    params = take(nnx.to_pure_dict(state), trained)
    step = jax.jit(lambda p, b: training.eval_step(p, b, graphdef=graphdef))
    sums = [jax.tree.map(np.asarray, step(params, b)) for b in batches]
    total = jax.tree.map(lambda *x: float(np.sum(x)), *sums)
    return {
        "accuracy": total["accuracy_sum"] / total["rows"],
        "loss": total["nll_sum"] / total["tokens"],
        "examples": int(total["rows"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workdir")
    parser.add_argument("--examples", type=int, default=256, help="test examples for accuracy")
    parser.add_argument("--rows", type=int, default=8, help="test rows for the selection stats")
    args = parser.parse_args()
    timing.check_sizes(parser, args)
    try:
        model, cfg, _ = checkpoint.load_for_eval(args.workdir)
    except (FileNotFoundError, ValueError) as e:
        parser.error(f"{args.workdir}: {e}")
    if not cfg.model.sparse.pattern or cfg.data.task not in ("joint_recall", "mqar"):
        parser.error(
            f"{args.workdir} has sparse pattern {cfg.model.sparse.pattern!r} and task "
            f"{cfg.data.task!r}: a joint_recall or mqar model with a sparse branch is needed"
        )
    batches, rows = [], 0
    for batch in pipeline.eval_batches(cfg, "", "test"):
        batches.append({k: v for k, v in batch.items() if k != "seq_idx"})
        rows += len(batch["inputs"])
        if rows >= args.examples:
            break
    for layer, inputs in enumerate(branch_inputs(model, batches[0]["inputs"][: args.rows])):
        print(json.dumps({"layer": layer, **selection_stats(*inputs)}), flush=True)
    pattern = cfg.model.sparse.spec.components
    for dropped in (None, *pattern):
        kept = "+".join(c for c in pattern if c != dropped)
        if kept:
            row = {"pattern": kept, **accuracy(model, cfg, kept, batches)}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
