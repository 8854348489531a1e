"""Memory the official HAX code's dense (batch x l x l) masks would take, computed, not run.

    python bench/official_mask_memory.py [--batch 64] [--lengths 1057 16513] [--layers 2]

The official Mamba-2 mixer (DeepGraphLearning/HAX at 73d3c18, src/modeling_enhanced_mamba2.py, the
`sparse_arch` branch) builds every mask of the HAX pattern (sign_bin_lsh + key_selection) as a
(b, l, l) tensor, l = the model's input length. Transcribed from that code, per layer's forward:

- `causal_seq_ids[None, None, :].repeat(b, l, 1)`: int64, 8 bytes an element, compared into the
  bool causal mask; the sink, sliding-window, dilated and argmax-LSH masks: `zeros_like` bools.
- `lsh_sliding_window`: `torch.cumsum(reversed_tensor.int(), dim=-1)`: int64 again (cumsum of an
  int32 tensor promotes), beside its bool flips and comparisons.
- the union as bf16 (`(1.0 - mask.to(V.dtype)) * finfo.min`), the scores `Q2 @ K2^T` plus it, and
  their softmax: bf16 (the HAX trainer runs the model in bf16), the softmax kept for the backward.

Reported: the size of one element of each kind, times b l^2. A forward needs at least one int64
array at a time, and the backward keeps one bf16 softmax per layer (a lower bound on the peak; the
many transient bool arrays come on top).
"""

import argparse

GIB = 2**30


def rows(batch: int, lengths: list[int], layers: int) -> list[dict]:
    """Per length: elements b l^2 and GiB of one int64, one bf16, one bool (b, l, l) array, and of
    the bf16 softmaxes all layers keep for the backward."""
    out = []
    for l in lengths:
        elements = batch * l * l
        out.append(
            dict(
                l=l,
                elements=elements,
                int64=8 * elements / GIB,
                bf16=2 * elements / GIB,
                bool=elements / GIB,
                kept=layers * 2 * elements / GIB,
            )
        )
    return out


def main():
    """Print the markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1057, 16513])
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    for name, value in [("--batch", args.batch), ("--layers", args.layers)] + [
        ("--lengths", l) for l in args.lengths
    ]:
        if value < 1:
            parser.error(f"{name} must be positive, got {value}")
    print(
        f"| l | b l^2 (b = {args.batch}) | one int64 array GiB | one bf16 GiB | one bool GiB "
        f"| bf16 softmaxes kept ({args.layers} layers) GiB |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows(args.batch, args.lengths, args.layers):
        print(
            f"| {r['l']:,} | {r['elements']:,} | {r['int64']:.1f} | {r['bf16']:.1f} "
            f"| {r['bool']:.1f} | {r['kept']:.1f} |"
        )


if __name__ == "__main__":
    main()
