"""Command-line options shared by ``bench run``, ``bench sweep`` and the experiments, and their parsing
into the harness's value objects. Every bad value becomes a UsageError naming the option."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from supervisor.bench.client import Target
from supervisor.bench.prompts import PromptSet, load_prompts
from supervisor.bench.runner import RequestOptions
from supervisor.bench.stats import Gates
from supervisor.errors import UsageError

DEFAULT_KEY_ENV = "LLAMAGATE_API_KEY"


def add_target_options(parser: argparse.ArgumentParser, required: bool = True) -> None:
    group = parser.add_argument_group("target")
    group.add_argument(
        "--url",
        required=required,
        help="OpenAI-compatible base URL (llamagate or llama-server), e.g. http://127.0.0.1:8080",
    )
    group.add_argument(
        "--api-key",
        help="API key (visible in `ps`; prefer --api-key-env). Redacted from the recorded command line.",
    )
    group.add_argument(
        "--api-key-env",
        metavar="VAR",
        help=f"read the API key from this environment variable (default: ${DEFAULT_KEY_ENV} if set)",
    )
    group.add_argument("--model", help="model id to request (default: the first id at /v1/models)")


def add_request_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("requests")
    group.add_argument(
        "--prompts",
        default="builtin",
        help="builtin (default) | FILE (a prompt a line; .jsonl: prompt or messages) | gen:TOKENS "
        "(fresh document per request) | shared:TOKENS (one shared document, varying questions)",
    )
    group.add_argument("--max-tokens", type=int, default=128, help="max output tokens per request (128)")
    group.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0)")
    group.add_argument("--seed", type=int, default=0, help="seed for prompt order, arrivals and sampling (0)")
    group.add_argument(
        "--ignore-eos",
        action="store_true",
        help="llama-server extension: every answer runs to --max-tokens (steadier TPOT)",
    )
    group.add_argument(
        "--extra-body", metavar="JSON", help="extra request fields, e.g. '{\"cache_prompt\": false}'"
    )
    group.add_argument(
        "--request-timeout", type=float, default=300.0, help="client-side deadline per request in s (300)"
    )
    group.add_argument("--warmup", type=int, default=2, help="warm-up requests, recorded apart (2)")


def add_gate_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("gates (verdict)")
    group.add_argument("--ttft-gate-ms", type=float, default=1500.0, help="TTFT gate in ms (1500)")
    group.add_argument("--tpot-gate-ms", type=float, default=120.0, help="TPOT gate in ms (120)")
    group.add_argument("--gate-percentile", type=float, default=95.0, help="percentile judged (95)")
    group.add_argument("--max-failures", type=int, default=0, help="failed requests allowed (0)")
    group.add_argument(
        "--max-rejected", type=float, default=0.0, help="fraction of 429/503 rejections allowed (0.0)"
    )


def add_output_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, help="result folder (default: ./bench-results/<kind>-<time>)")


def resolve_key(args: argparse.Namespace) -> str | None:
    if args.api_key:
        return str(args.api_key)
    name = args.api_key_env or DEFAULT_KEY_ENV
    value = os.environ.get(name)
    if args.api_key_env and not value:
        raise UsageError(f"--api-key-env {name}: environment variable is not set")
    return value or None


def target(args: argparse.Namespace) -> Target:
    url = str(args.url)
    if not url.startswith(("http://", "https://")):
        raise UsageError(f"--url {url}: expected http:// or https://")
    return Target(url, resolve_key(args))


def request_options(args: argparse.Namespace) -> RequestOptions:
    if args.max_tokens < 1:
        raise UsageError("--max-tokens must be >= 1")
    if args.request_timeout <= 0:
        raise UsageError("--request-timeout must be > 0")
    extra: dict[str, Any] = {}
    if args.extra_body:
        try:
            extra = json.loads(args.extra_body)
        except json.JSONDecodeError as exc:
            raise UsageError(f"--extra-body: invalid JSON ({exc.msg})") from exc
        if not isinstance(extra, dict):
            raise UsageError("--extra-body: expected a JSON object")
    return RequestOptions(
        model=getattr(args, "model", None),
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        extra_body=extra,
        timeout_s=args.request_timeout,
    )


def prompts(args: argparse.Namespace) -> PromptSet:
    return load_prompts(args.prompts, args.seed)


def gates(args: argparse.Namespace) -> Gates:
    try:
        return Gates(
            ttft_ms=args.ttft_gate_ms,
            tpot_ms=args.tpot_gate_ms,
            percentile=args.gate_percentile,
            max_failures=args.max_failures,
            max_rejected_fraction=args.max_rejected,
        )
    except ValueError as exc:
        raise UsageError(f"gates: {exc}") from exc


def out_dir(args: argparse.Namespace, kind: str) -> Path:
    if args.out is not None:
        return Path(args.out)
    return Path("bench-results") / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"
