"""``llamagate build``: build (or find in the cache) the llama-server the lock pins."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from supervisor.artifacts.build import InstalledBinary, ensure_binary
from supervisor.artifacts.lock import DEFAULT_VARIANT, load_lock
from supervisor.artifacts.tools import TOOLS
from supervisor.interrupts import sigterm_as_interrupt
from supervisor.paths import default_lock_path
from supervisor.progress import ConsoleProgress


def add_lock_and_cache(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lock", type=Path, default=None, help="llama-build.lock to use (default: the checkout's)"
    )
    parser.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="cache folder (default: $LLAMAGATE_CACHE_DIR, else $XDG_CACHE_HOME/llamagate)",
    )


def add_variant(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--variant",
        default=DEFAULT_VARIANT,
        metavar="NAME",
        help="which of the lock's builds: cpu (default) or a [variant.NAME] table, e.g. vulkan",
    )


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "build",
        help="build the pinned llama-server (a cache hit when already built)",
        description="Fetch the locked llama.cpp source, check its sha256, build llama-server with the "
        "locked cmake arguments and install it into the cache with a receipt. Exit 0 ok, 1 build or "
        "check failed, 2 bad lock or usage.",
    )
    add_lock_and_cache(parser)
    add_variant(parser)
    parser.add_argument("--print-digest", action="store_true", help="print the lock's digest and exit")
    parser.add_argument(
        "--print-packages",
        nargs="?",
        const="build",
        choices=("build", "runtime"),
        default=None,
        help="print the Debian packages the variant's build (or, with 'runtime', its binary) needs,"
        " space-separated (none for cpu), and exit",
    )
    parser.add_argument(
        "--target",
        choices=("llama-server", *TOOLS),
        default=None,
        help="what to build: llama-server (default) or a tool from the same sources and cmake arguments",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(func=run)


def interruptible() -> None:
    """Turn SIGTERM into KeyboardInterrupt so a killed build still runs its cleanup (and kills cmake)."""
    sigterm_as_interrupt()


def identity_lines(installed: InstalledBinary) -> list[str]:
    r = installed.receipt
    version = r.version_output.splitlines()[0] if r.version_output else "?"
    return [
        f"  llama.cpp commit: {r.llama_cpp_commit}",
        f"  variant:          {r.variant}" + "".join(f"\n  patch:            {p}" for p in r.patches),
        f"  version:          {version}",
        f"  binary sha256:    {r.binary_sha256}",
        f"  lock digest:      {r.lock_digest}",
        f"  source:           {r.source} (sha256 {r.source_sha256})",
        f"  compilers:        {'; '.join(r.compilers)}",
        f"  built at:         {r.built_at} in {r.build_seconds:.0f} s",
    ]


def run(args: argparse.Namespace) -> int:
    lock_path: Path = args.lock or default_lock_path()
    if args.print_digest:
        print(load_lock(lock_path, args.variant).digest)
        return 0
    if args.print_packages:
        lock = load_lock(lock_path, args.variant)
        print(" ".join(lock.packages if args.print_packages == "build" else lock.runtime_packages))
        return 0
    interruptible()
    started = time.monotonic()
    installed = ensure_binary(
        lock_path, cache=args.cache, progress=ConsoleProgress(), target=args.target, variant=args.variant
    )
    elapsed = time.monotonic() - started
    if args.json:
        print(
            json.dumps(
                {
                    "path": str(installed.path),
                    "cache_hit": installed.cache_hit,
                    "seconds": round(elapsed, 3),
                    "receipt": installed.receipt.to_json(),
                },
                indent=2,
            )
        )
        return 0
    how = "cache hit" if installed.cache_hit else "built"
    print(f"{installed.receipt.target}: {installed.path} ({how}, {elapsed:.1f} s)")
    print("\n".join(identity_lines(installed)))
    return 0
