"""`make bench-fabric`: parse + analyse the largest real ibnetdiscover sample and a generated
4,000-node, 3-tier, 8-rail fabric.

For each text it prints the time of parse + analysis and its peak memory growth beside a baseline
measured in the same run: a bare pass that splits every line of the same text on whitespace (what
reading the text costs at least). Times are this process's CPU time (`time.process_time`), the best
of --repeat runs each, interleaved: on a shared machine wall time measured how often the neighbours
preempted each pass more than the pass (a 60 ms split finds a quiet moment far more often than a
2 s analysis: at load 22 on 2 cores the wall-time ratio read 22-29x where CPU time reads 15-16x,
slice 1's 13-15x on a quieter machine). Memory is traced (tracemalloc) in a separate run, since
tracing slows the code it measures.

Bars (issue 13): parse + analyse ≤ 20× the bare pass; peak memory growth ≤ 10× the text's size.
What decided the code's shape (2-core machine, this bench): msgspec Structs with gc=False (the
collector's passes over 100k+ tracked objects cost a third of the analysis), one regex match per
port line, GUID tokens normalised once.
"""

from __future__ import annotations

import argparse
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

from llmgw.fabric.analysis import analyse
from llmgw.fabric.ibnetdiscover import parse_topology
from llmgw.sim.fabric import FabricSpec, generate

ROOT = Path(__file__).resolve().parents[1]
LARGEST = ROOT / "tests" / "fixtures" / "real" / "ibnetdiscover" / "dgx-a100-superpod-hdr-206sw-sharp-an.txt"
TIME_BAR = 20.0
MEMORY_BAR = 10.0


def bare_pass(text: str) -> int:
    words = 0
    for line in text.splitlines():
        words += len(line.split())
    return words


def full_pass(text: str) -> int:
    return len(analyse(parse_topology(text)).links)


def best(fn: Callable[[str], int], text: str) -> float:
    """CPU seconds of one run (single-threaded: the process's CPU time is the pass's)."""
    t0 = time.process_time()
    fn(text)
    return time.process_time() - t0


def peak(fn: Callable[[str], int], text: str) -> int:
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    fn(text)
    top = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return top - before


def measure(label: str, text: str, repeat: int) -> bool:
    size = len(text.encode())
    base = full = float("inf")
    for _ in range(repeat):
        base = min(base, best(bare_pass, text))
        full = min(full, best(full_pass, text))
    ratio = full / base
    memory = peak(full_pass, text)
    mem_ratio = memory / size
    print(f"{label}: {size / 1e6:.2f} MB, {text.count(chr(10)):,} lines")
    print(f"  parse + analyse {full * 1000:.0f} ms CPU; bare whitespace split {base * 1000:.1f} ms CPU; "
          f"ratio {ratio:.1f}× (bar {TIME_BAR:.0f}×)")
    print(f"  peak memory growth {memory / 1e6:.1f} MB = {mem_ratio:.1f}× the text (bar {MEMORY_BAR:.0f}×)")
    return ratio <= TIME_BAR and mem_ratio <= MEMORY_BAR


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=4000)
    parser.add_argument("--rails", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    ok = measure(f"real: {LARGEST.name}", LARGEST.read_text(encoding="utf-8"), args.repeat)
    spec = FabricSpec(nodes=[f"gpu-{i:04d}" for i in range(args.nodes)], rails=args.rails, group_size=32,
                      spines=4, core=16, groups_per_pod=4)
    text = generate(spec).ibnetdiscover
    ok = measure(f"generated: {args.nodes:,} nodes × {args.rails} rails, 3 tiers", text, args.repeat) and ok
    print("  within the bars" if ok else "  OVER A BAR")


if __name__ == "__main__":
    main()
