"""``python -m tests.benchmarks.cache``: what strict prompt-cache isolation costs
(``tenants[].cache_prompt: false``).

One private daemon (the demo model unless ``--config`` says otherwise), 2 slots, two tenants that differ
only in ``cache_prompt``. Each round sends the same long prefix (a conversation so far, ``--prefix-words``
words) plus a new turn, once per tenant, in alternating order, as a one-token completion: the time is
almost all prompt processing. The shared tenant reuses the cached prefix; the strict one processes the
whole prompt every time. Reported per tenant: the median of llama-server's own ``timings.prompt_ms``,
``prompt_n`` and ``cache_n``, and the median wall time of the request through the proxy.

It measures; it has no target. Exit status 0, or 2 on bad usage.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from supervisor.bench.launcher import deep_merge, read_base_config, start_llamagate
from supervisor.child.spawn import free_port
from supervisor.config.keys import ADMIN, new_key_config
from supervisor.errors import UsageError
from supervisor.progress import ConsoleProgress
from tests.benchmarks import cli

TENANTS = ("shared", "strict")
_TEXT = (
    "the keeper of the northern light wrote down every ship that passed the cape and every storm that "
    "turned them back before the harbour could be reached"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="base llamagate config (default: the embedded default)")
    parser.add_argument("--rounds", type=int, default=10, help="rounds, one request per tenant each (10)")
    parser.add_argument("--prefix-words", type=int, default=1000, help="words in the shared prefix (1000)")
    parser.add_argument("--out", type=Path, help="write the full results as JSON here")


def _config(base: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    keys: dict[str, str] = {}
    entries = []
    for tenant in TENANTS:
        keys[tenant], entry = new_key_config(tenant, ADMIN)  # admin: to read the timings
        entries.append(entry)
    overrides = {
        "proxy": {"host": "127.0.0.1", "port": free_port()},
        "llama": {"slots": 2, "ctx_per_slot": 4096},
        "tenants": [
            {"name": "shared", "max_concurrency": 1, "cache_prompt": True},
            {"name": "strict", "max_concurrency": 1, "cache_prompt": False},
        ],
        "keys": entries,
    }
    return deep_merge(base, overrides), keys


def _ask(client: httpx.Client, url: str, key: str, prompt: str) -> dict[str, float]:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    started = time.monotonic()
    response = client.post(url, json=body, headers={"Authorization": f"Bearer {key}"})
    wall_ms = (time.monotonic() - started) * 1000
    response.raise_for_status()
    timings = response.json()["timings"]
    return {
        "wall_ms": wall_ms,
        "prompt_ms": float(timings["prompt_ms"]),
        "prompt_n": float(timings["prompt_n"]),
        "cache_n": float(timings["cache_n"]),
    }


def handle(args: argparse.Namespace) -> int:
    if args.rounds < 1 or args.prefix_words < 10:
        raise UsageError("--rounds must be >= 1 and --prefix-words >= 10")
    config, keys = _config(read_base_config(args.config))
    words = _TEXT.split(" ")
    prefix = " ".join(words[i % len(words)] for i in range(args.prefix_words))
    samples: dict[str, list[dict[str, float]]] = {t: [] for t in TENANTS}
    with tempfile.TemporaryDirectory(prefix="llamagate-bench-cache-") as folder:
        launched = start_llamagate(config, keys["shared"], Path(folder), progress=ConsoleProgress())
        try:
            url = f"{launched.target.server_root}/v1/completions"
            with httpx.Client(timeout=600, trust_env=False) as client:
                _ask(client, url, keys["shared"], prefix)  # warm: the prefix is in the cache
                for i in range(args.rounds):
                    prompt = f"{prefix}\nTurn {i}: and what came after that?"
                    order = TENANTS if i % 2 == 0 else TENANTS[::-1]
                    for tenant in order:
                        samples[tenant].append(_ask(client, url, keys[tenant], prompt))
        finally:
            launched.stop()
    medians = {t: {k: statistics.median(s[k] for s in samples[t]) for k in samples[t][0]} for t in TENANTS}
    results = {
        "command": cli.command_line("cache"),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "identity": launched.identity,
        "rounds": args.rounds,
        "prefix_words": args.prefix_words,
        "median": medians,
        "samples": samples,
    }
    print(json.dumps(results, indent=2, default=str))
    shared, strict = medians["shared"], medians["strict"]
    print(
        f"prompt_ms median: shared {shared['prompt_ms']:.0f} (cache_n {shared['cache_n']:.0f}), "
        f"strict {strict['prompt_ms']:.0f} (cache_n {strict['cache_n']:.0f}); "
        f"wall ms: shared {shared['wall_ms']:.0f}, strict {strict['wall_ms']:.0f}"
    )
    if args.out:
        args.out.write_text(json.dumps(results, indent=2, default=str) + "\n", encoding="utf-8")
    return 0


def main() -> int:
    return cli.run("cache", __doc__, add_arguments, handle)


if __name__ == "__main__":
    raise SystemExit(main())
