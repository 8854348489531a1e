"""Which buffers are live at the peak of a compiled step's schedule, by source line.

    python bench/hlo_liveness.py STEP.hlo.txt [MORE.hlo.txt ...] [--top 12]

Reads the optimized HLO that `bench/train_throughput.py --hlo-dir` writes: a scheduled module, the
entry computation's instructions in the order they run. Each instruction's result arrays (a tuple's
elements apart; an async start's result, not its operands) are live from that instruction to the
last that reads them, directly or through a bitcast, get-tuple-element, tuple or async done, which
alias it; parameters and constants are not counted. Prints the peak of the live bytes, the largest
buffers live there (where each is made and last read) and the live bytes per source line
(kernel_attribution's frames). A rougher count than XLA's buffer assignment (which also reuses
an operand's buffer for a result and packs small ones): for where two steps differ, not for their
absolute temporaries (compiled.memory_analysis() gives those).
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

INSTRUCTION = re.compile(r"\s+(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$")
ALIASES = {"bitcast", "get-tuple-element", "tuple", "parameter", "constant"}


class Instruction(NamedTuple):
    name: str
    shape: str  # the result type text, e.g. "(f32[2,3]{1,0}, bf16[4]{0})"
    op: str
    operands: list[str]
    line: str


def entry_instructions(text: str) -> list[Instruction]:
    """The entry computation's instructions, in schedule order."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("ENTRY"))
    out = []
    for line in lines[start + 1 :]:
        if line.startswith("}"):
            break
        m = INSTRUCTION.match(line)
        if m:
            arguments = re.split(r"\), [a-z_]+=", m[4])[0]  # drop attributes (calls=, ...)
            out.append(Instruction(m[1], m[2], m[3], re.findall(r"%([\w.\-]+)", arguments), line))
    return out


def buffers(instructions: list[Instruction]) -> tuple[dict, dict, dict]:
    """({buffer: bytes}, {buffer: index made}, {buffer: index last read}); a buffer is
    "name#k", the k-th array of an instruction's result."""
    refers = {}  # instruction -> the buffers its value is
    size, made, last = {}, {}, {}
    for i, ins in enumerate(instructions):
        if ins.op == "get-tuple-element":
            index = int(re.search(r"index=(\d+)", ins.line)[1])
            source = refers.get(ins.operands[0], [])
            refers[ins.name] = source[index : index + 1] if len(source) > 1 else source
        elif ins.op in ALIASES:
            refers[ins.name] = [b for o in ins.operands for b in refers.get(o, [])]
        elif ins.op.endswith("-done"):
            refers[ins.name] = refers.get(ins.operands[0], [])
        else:
            sizes = result_bytes(ins.shape, ins.op)
            refers[ins.name] = [f"{ins.name}#{k}" for k in range(len(sizes))]
            for buffer, nbytes in zip(refers[ins.name], sizes):
                size[buffer], made[buffer] = nbytes, i
        for operand in ins.operands:
            for buffer in refers.get(operand, []):
                last[buffer] = i
    return size, made, {b: last.get(b, made[b]) for b in size}


def peak(size: dict, made: dict, last: dict) -> tuple[int, int, list[str]]:
    """(peak live bytes, the schedule index where it is reached, the buffers live there)."""
    change = collections.Counter()
    for buffer, nbytes in size.items():
        change[made[buffer]] += nbytes
        change[last[buffer] + 1] -= nbytes
    live = best = at = 0
    for i in sorted(change):
        live += change[i]
        if live > best:
            best, at = live, i
    return best, at, [b for b in size if made[b] <= at <= last[b]]


def report(path: str, top: int) -> None:
    """Prints the peak, its largest buffers and its bytes per source line; SystemExit naming a
    file that cannot be read."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise SystemExit(f"error: cannot read {path}: {e.strerror}") from None
    instructions = entry_instructions(text)
    size, made, last = buffers(instructions)
    best, at, live = peak(size, made, last)
    sources = hlo_sources(path)
    print(f"{path}: peak {best / 2**30:.2f} GiB at instruction {at} of {len(instructions)}")
    for buffer in sorted(live, key=size.get, reverse=True)[:top]:
        ins = instructions[made[buffer]]
        source = sources.get(profiler_name(ins.name), "?")
        print(
            f"  {size[buffer] / 2**20:9.1f} MiB  made {made[buffer]:6d}  last read "
            f"{last[buffer]:6d}  {ins.op:16s} {source}"
        )
    by_source = collections.Counter()
    for buffer in live:
        by_source[sources.get(profiler_name(buffer.split("#")[0]), "?")] += size[buffer]
    print("  live bytes per source line:")
    for source, nbytes in by_source.most_common(top):
        print(f"  {nbytes / 2**20:9.1f} MiB  {source}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("hlo", nargs="+", help="optimized HLO text of a scheduled step")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    if args.top < 1:
        parser.error(f"--top must be at least 1, got {args.top}")
    for path in args.hlo:
        try:
            report(path, args.top)
        except StopIteration:
            raise SystemExit(f"error: {path} has no ENTRY computation") from None


if __name__ == "__main__":
    main()
