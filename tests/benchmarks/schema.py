"""``python -m tests.benchmarks.schema``: what the door's request schema (``proxy.schema.check_body``)
costs per request, on the bodies real clients send, in this process (no server: the check is a pure
function of the parsed body, called once per request before admission).

Bodies: the OpenAI SDK's chat request (messages and five sampling fields), a llama.cpp ``/completion``
with twenty fields of the pinned schema (grammar triggers, logit bias, stop strings...), a prompt of 4,000
token ids (every id checked against the vocabulary: the worst ordinary case), and an Anthropic Messages
request with tools. Each is checked ``--rounds`` times after a warm-up; the median of five repetitions is
printed per body in microseconds, with the parse of the same body (``proxy.asgi.body.parse_object``) for
scale. The alarm (exit 1) is 100 us for any body but the token prompt, 2 ms for it: a regression alarm,
not a target (issue 48).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from proxy.asgi.body import parse_object
from proxy.schema import Context, check_body
from proxy.settings import TenantSettings
from supervisor.errors import UsageError
from tests.benchmarks import cli

TENANT = TenantSettings("bench", max_concurrency=4, max_tokens=None)
CTX = Context(TENANT, admin=False, capacity=4, n_vocab=49152)

BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "openai chat (SDK)": (
        "chat",
        {
            "model": "smollm2-135m-instruct",
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Hello, how are you today? " * 8},
            ],
            "max_tokens": 64,
            "temperature": 0.7,
            "top_p": 0.9,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ),
    "/completion, 20 fields": (
        "completion",
        {
            "prompt": "Say yes or no: " * 10,
            "n_predict": 16,
            "temperature": 0.2,
            "top_k": 40,
            "top_p": 0.95,
            "min_p": 0.05,
            "repeat_penalty": 1.1,
            "repeat_last_n": 64,
            "seed": 42,
            "stop": ["\n", "###"],
            "grammar": 'root ::= "yes" | "no"',
            "grammar_lazy": True,
            "grammar_triggers": [{"type": 2, "value": "yes"}, {"type": 0, "value": "no", "token": 1217}],
            "preserved_tokens": ["yes", "no"],
            "logit_bias": [[15, -1.0], [16, False]],
            "n_probs": 5,
            "cache_prompt": True,
            "samplers": ["top_k", "top_p", "min_p", "temperature"],
            "stream": False,
            "return_tokens": False,
        },
    ),
    "/completion, 4,000 token ids": ("completion", {"prompt": list(range(4000)), "n_predict": 8}),
    "anthropic messages + tools": (
        "messages",
        {
            "model": "smollm2-135m-instruct",
            "max_tokens": 256,
            "system": "You call tools.",
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": [
                {
                    "name": "weather",
                    "description": "Current weather",
                    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
                }
            ],
            "temperature": 0.5,
        },
    ),
}
ALARM_US = {"/completion, 4,000 token ids": 2000.0}
DEFAULT_ALARM_US = 100.0


def _per_call_us(fn: Callable[[], object], rounds: int) -> float:
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(rounds):
            fn()
        runs.append((time.perf_counter() - start) / rounds * 1e6)
    return statistics.median(runs)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=2000, help="checks per repetition (2000)")


def handle(args: argparse.Namespace) -> int:
    if args.rounds < 1:
        raise UsageError("--rounds must be >= 1")
    print(f"python {platform.python_version()} on {platform.machine()}, {args.rounds} rounds x 5, median")
    ok = True
    for name, (schema, payload) in BODIES.items():
        raw = json.dumps(payload).encode()
        generates = schema in ("chat", "completion", "messages")

        def check(schema: str = schema, raw: bytes = raw, generates: bool = generates) -> object:
            # A fresh parse each time: the check may rewrite the body (the token cap), as per request.
            return check_body(schema, parse_object(raw), CTX, "refuse", generates=generates)

        def parse(raw: bytes = raw) -> object:
            return parse_object(raw)

        check()  # warm-up, and the body must pass
        both = _per_call_us(check, args.rounds)
        parse_us = _per_call_us(parse, args.rounds)
        cost = max(0.0, both - parse_us)
        alarm = ALARM_US.get(name, DEFAULT_ALARM_US)
        flag = "" if cost <= alarm else f"  ALARM (> {alarm:g} us)"
        ok = ok and cost <= alarm
        print(f"{name:32} check {cost:8.1f} us   (parse {parse_us:8.1f} us, {len(raw):6} bytes){flag}")
    return 0 if ok else 1


def main() -> int:
    return cli.run("schema", __doc__, add_arguments, handle)


if __name__ == "__main__":
    sys.exit(main())
