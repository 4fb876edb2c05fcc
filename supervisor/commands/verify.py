"""``llamagate verify``: prove the installed llama-server is the locked one and that it decodes."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import fields
from pathlib import Path

from supervisor.artifacts.files import is_sha256
from supervisor.artifacts.verify import VerifyReport, verify
from supervisor.commands.build import add_lock_and_cache, add_variant
from supervisor.errors import UsageError
from supervisor.launch.knobs import LlamaKnobs
from supervisor.paths import default_lock_path
from supervisor.progress import ConsoleProgress, NullProgress, Progress


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "verify",
        help="check the built llama-server against its receipt and the lock, then decode one token",
        description="Checks that the binary hashes to its receipt, that --version reports the locked "
        "commit, and (unless --no-serve) that it starts on a private port with the demo model (or "
        "--model) and decodes one token. Exit 0 ok, 1 a check failed, 2 usage or lock error.",
    )
    add_lock_and_cache(parser)
    add_variant(parser)
    parser.add_argument(
        "--vulkan-devices",
        default=os.environ.get("GGML_VK_VISIBLE_DEVICES"),
        metavar="INDEXES",
        help="Vulkan devices the child may use (llama.vulkan_devices: GGML_VK_VISIBLE_DEVICES, default from"
        " the environment); a CPU-type device such as lavapipe is used only when named, e.g. 0",
    )
    parser.add_argument(
        "--device", default=None, metavar="NAMES", help="llama.device: --device for the child, e.g. Vulkan0"
    )
    parser.add_argument("--model", type=Path, default=None, help="a GGUF model to check (and serve)")
    parser.add_argument("--model-sha256", default=None, metavar="HEX", help="expected sha256 of --model")
    parser.add_argument("--no-serve", action="store_true", help="skip starting llama-server")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if (args.model is None) != (args.model_sha256 is None):
        raise UsageError("--model and --model-sha256 go together")
    if args.model_sha256 is not None and not is_sha256(args.model_sha256.lower()):
        raise UsageError(f"--model-sha256 must be 64 hex characters, got {args.model_sha256!r}")
    progress: Progress = NullProgress() if args.json else ConsoleProgress()
    report = verify(
        args.lock or default_lock_path(),
        cache=args.cache,
        model=args.model,
        model_sha256=None if args.model_sha256 is None else args.model_sha256.lower(),
        serve=not args.no_serve,
        progress=progress,
        variant=args.variant,
        knobs=_knobs(args),
    )
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        _print_text(report)
    return 0 if report.ok else 1


def _knobs(args: argparse.Namespace) -> LlamaKnobs:
    """The device knobs, checked as the config checks them."""
    values = {"variant": args.variant, "vulkan_devices": args.vulkan_devices or None, "device": args.device}
    for f in fields(LlamaKnobs):
        check = f.metadata.get("check")
        problem = check(values[f.name]) if f.name in values and check is not None else None
        if problem:
            option = "--" + f.name.replace("_", "-")
            raise UsageError(f"{option} {values[f.name]!r}: {problem}")
    return LlamaKnobs(**values)


def _print_text(report: VerifyReport) -> None:
    if report.binary is not None:
        print(f"llama-server: {report.binary}")
    if report.receipt is not None:
        r = report.receipt
        print(f"  llama.cpp commit: {r.llama_cpp_commit}")
        print(f"  variant:          {r.variant}" + "".join(f"\n  patch:            {p}" for p in r.patches))
        print(f"  binary sha256:    {r.binary_sha256} (receipt)")
        print(f"  lock digest:      {r.lock_digest}")
    for check in report.checks:
        mark = "ok  " if check.ok and not check.warning else ("WARN" if check.ok else "FAIL")
        print(f"{mark}  {check.name:<9} {check.detail}")
    failed = report.failed
    if failed is None:
        print("verify: ok")
    else:
        print(f"verify: FAILED ({failed.name})", file=sys.stderr)
