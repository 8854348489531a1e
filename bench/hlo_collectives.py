"""Which source lines a compiled step's collectives come from, and which run in a recompute.

    python bench/hlo_collectives.py STEP.hlo.txt [MORE.hlo.txt ...]

Reads HLO text with its stack frames (`bench/train_throughput.py --hlo-dir`, or an XLA dump such as
`--xla_dump_to=DIR --xla_dump_hlo_pass_re=spmd-partitioning`) and lists its collectives grouped by
kind, by whether they run in a rematerialised computation (jax.checkpoint's backward recompute:
"rematted_computation" in their op name) and by the innermost hax_jax / pallas_kernels frame
(kernel_attribution's), with their count and the bytes of their results. A collective rerun in the
recompute depends only on its own block's input, so XLA may join those of many blocks into one
that waits on every block's recompute (the forty-second session's HAX 64K on seq=2). A collective
XLA joined from several carries the metadata of one of them.
"""

import argparse
import collections
import re
import sys
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kernel_attribution import hlo_sources, profiler_name
from bench.timing import result_bytes

KINDS = "all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all"
# "%name = TYPE kind(" or "%name = TYPE kind-start(": the name, the result type, the kind.
COLLECTIVE = re.compile(rf"^\s*(?:ROOT )?%([\w.\-]+) = (\S+|\(.*?\)) ({KINDS})(-start)?\(")


class Group(NamedTuple):
    """Collectives of one kind and source line, in a recompute or not."""

    kind: str
    recompute: bool
    source: str


def collectives(text: str, sources: dict[str, str]) -> dict[Group, list[int]]:
    """{Group: [count, bytes of the results]} of the collectives in HLO `text`; `sources` maps
    profiler names to source lines (kernel_attribution.hlo_sources)."""
    groups = collections.defaultdict(lambda: [0, 0])
    for line in text.splitlines():
        m = COLLECTIVE.match(line)
        if not m:
            continue
        group = Group(m[3], "rematted_computation" in line, sources.get(profiler_name(m[1]), "?"))
        groups[group][0] += 1
        groups[group][1] += sum(result_bytes(m[2], m[3] + (m[4] or "")))
    return dict(groups)


def report(path: str) -> None:
    """Prints the collectives of one HLO file by group; SystemExit naming a file that cannot be
    read."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise SystemExit(f"error: cannot read {path}: {e.strerror}") from None
    groups = collectives(text, hlo_sources(path))
    rerun = [v for g, v in groups.items() if g.recompute]
    print(
        f"{path}: {sum(v[0] for v in groups.values())} collectives, "
        f"{sum(v[1] for v in groups.values()) / 2**20:.2f} MiB; in a recompute "
        f"{sum(v[0] for v in rerun)}, {sum(v[1] for v in rerun) / 2**20:.2f} MiB"
    )
    for group, (count, nbytes) in sorted(groups.items(), key=lambda kv: (-kv[0].recompute, kv[0])):
        where = "recompute" if group.recompute else ""
        print(
            f"  {count:5d}  {nbytes / 2**20:10.2f} MiB  {group.kind:18s} {where:9s}  {group.source}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("hlo", nargs="+", help="HLO text with stack frames")
    for path in parser.parse_args().hlo:
        report(path)


if __name__ == "__main__":
    main()
