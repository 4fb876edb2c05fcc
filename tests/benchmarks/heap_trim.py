"""``python -m tests.benchmarks.heap_trim``: what one of the daemon's heap trims costs
(``supervisor.daemon.heap``).

For each ``--mib``: that many MiB of 4 KiB blocks allocated (glibc's malloc serves them, past pymalloc's
512 bytes), all but one in 64 freed, so the freed memory is inside the heap where glibc keeps it; then
``malloc_trim(0)`` timed twice: the first gives the freed pages back, the second walks the same heap
with nothing new freed (what most of the daemon's trims find). The median of ``--repeat`` times each.
Prints a markdown table; it measures and asserts nothing. Exit status 0, or 2 on bad usage or without
glibc.
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import sys
import time

from supervisor.daemon.heap import malloc_trim
from supervisor.errors import UsageError
from tests.benchmarks import cli

BLOCK = 4096


def freed_pages_kept_by_malloc(mib: int) -> list[bytes]:
    """``mib`` MiB of 4 KiB blocks of which one in 64 stays allocated, the last one too: what is freed
    is inside the heap, never at its top, so glibc keeps it as free heap and RSS stays where it was
    (what requests leave in the daemon). Returns the blocks still allocated."""
    blocks = [bytes(BLOCK - 64) + bytes([i % 256]) for i in range(mib * (1 << 20) // BLOCK)]
    kept = [*blocks[::64], blocks[-1]]
    del blocks
    gc.collect()
    return kept


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mib", type=int, nargs="+", default=[4, 16, 64], help="freed heap sizes (4 16 64)")
    parser.add_argument("--repeat", type=int, default=5, help="times each, the median reported (5)")


def handle(args: argparse.Namespace) -> int:
    trim = malloc_trim()
    if trim is None:
        raise UsageError("no malloc_trim in this C library (not glibc): nothing to measure")
    if args.repeat < 1 or min(args.mib) < 1:
        raise UsageError("--mib and --repeat must be >= 1")
    print(f"python {platform.python_version()} on {platform.machine()}, median of {args.repeat}")
    print("| freed heap (MiB) | first trim (ms) | again, nothing new freed (ms) |")
    print("|---:|---:|---:|")
    for mib in args.mib:
        first: list[float] = []
        again: list[float] = []
        for _ in range(args.repeat):
            kept = freed_pages_kept_by_malloc(mib)
            for times in (first, again):
                started = time.perf_counter()
                trim()
                times.append((time.perf_counter() - started) * 1000)
            del kept
        print(f"| {mib} | {statistics.median(first):.2f} | {statistics.median(again):.3f} |")
    return 0


def main() -> int:
    return cli.run("heap_trim", __doc__, add_arguments, handle)


if __name__ == "__main__":
    sys.exit(main())
