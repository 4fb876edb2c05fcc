"""``python -m tests.benchmarks.models``: several models behind one door, measured.

One private daemon with the demo model (or ``--config``'s ``llama`` section) under three names, one slot
and one decode thread each: ``chat`` (always), ``chat-od`` (on_demand, ``idle_unload_s`` 2) and ``embed``
(always, embeddings). Three measurements, each ``--rounds`` times:

- cold vs warm: time to first token of a streamed chat request to ``chat-od`` when it is unloaded (its
  load included: the request's arrival to its first token) and right after, when it is loaded;
- one vs two at once: time per output token of ``chat`` streaming ``--tokens`` tokens alone, then of
  ``chat`` and ``chat-od`` streaming at the same time (each child has its own thread: on a host with
  fewer free cores than threads they take turns);
- RAG: an embedding of a question, then a chat request with it, through one key (wall times).

It measures; it has no target. Exit status 0, or 2 on bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from supervisor.bench.client import Exchange, Target, stream_chat
from supervisor.bench.launcher import deep_merge, llamagate_overrides, read_base_config, start_llamagate
from supervisor.bench.stats import tpot_ms, ttft_ms
from supervisor.errors import UsageError
from supervisor.progress import ConsoleProgress
from tests.benchmarks import cli

IDLE_UNLOAD_S = 2.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="base llamagate config (its llama section is shared)")
    parser.add_argument("--rounds", type=int, default=5, help="repetitions of each measurement (5)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per streamed answer (64)")
    parser.add_argument("--out", type=Path, help="write the full results as JSON here")


def _config(base: dict[str, Any]) -> tuple[dict[str, Any], str]:
    overrides, key = llamagate_overrides(admit=4, max_queue=8, queue_timeout_s=600)
    one = {"slots": 1, "ctx_per_slot": 1024, "threads": 1}
    overrides["models"] = [
        {"name": "chat", **one},
        {"name": "chat-od", "residency": "on_demand", "idle_unload_s": IDLE_UNLOAD_S, **one},
        {"name": "embed", "embeddings": True, "extra_args": ["--pooling", "mean"], **one},
    ]
    overrides["llama"] = {"prompt_cache_mib": 0}
    return deep_merge(base, overrides), key


class _Streams:
    """Streamed chat answers through the harness's stream timer; each one's TTFT (from the request's
    start) and time per token (between its streamed tokens), in ms."""

    def __init__(self, client: httpx.AsyncClient, target: Target) -> None:
        self.client = client
        self.target = target

    async def one(self, model: str, tokens: int) -> Exchange:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}],
            "max_tokens": tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        ex = await stream_chat(self.client, self.target, body, 600.0)
        if ex.outcome != "ok":
            raise RuntimeError(f"{model}: {ex.error}")
        return ex


def _ttft(ex: Exchange) -> float | None:
    return ttft_ms(ex.t_send or 0.0, ex.t_first_content)


def _tpot(ex: Exchange) -> float | None:
    return tpot_ms(ex.t_first_content, ex.t_last_content, ex.content_events)


async def _state(client: httpx.AsyncClient, target: Target, model: str) -> str:
    r = await client.get(target.api_root + "/models", headers=target.headers())
    r.raise_for_status()
    return str(next(m["llamagate"]["state"] for m in r.json()["data"] if m["id"] == model))


async def _wait_unloaded(client: httpx.AsyncClient, target: Target, model: str) -> None:
    deadline = time.monotonic() + IDLE_UNLOAD_S + 60
    while await _state(client, target, model) != "unloaded":
        if time.monotonic() > deadline:
            raise RuntimeError(f"{model} was not unloaded within its idle time + 60 s")
        await asyncio.sleep(0.2)


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 1) if present else None


async def _measure(target: Target, rounds: int, tokens: int) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
        streams = _Streams(client, target)
        cold: list[Exchange] = []
        warm: list[Exchange] = []
        for _ in range(rounds):
            await _wait_unloaded(client, target, "chat-od")
            cold.append(await streams.one("chat-od", 8))
            warm.append(await streams.one("chat-od", 8))
        alone: list[Exchange] = []
        pair: list[tuple[Exchange, Exchange]] = []
        for _ in range(rounds):
            alone.append(await streams.one("chat", tokens))
            a, b = await asyncio.gather(streams.one("chat", tokens), streams.one("chat-od", tokens))
            pair.append((a, b))
        rag = [await _rag(client, target) for _ in range(rounds)]
    return {
        "median": {
            "on_demand_ttft_ms": {
                "cold": _median([_ttft(s) for s in cold]),
                "warm": _median([_ttft(s) for s in warm]),
            },
            "tpot_ms": {
                "chat_alone": _median([_tpot(s) for s in alone]),
                "chat_with_other": _median([_tpot(a) for a, _ in pair]),
                "other_with_chat": _median([_tpot(b) for _, b in pair]),
            },
            "rag_ms": {k: _median([r[k] for r in rag]) for k in ("embed", "chat", "total")},
        },
        "samples": {
            "cold_ttft_ms": [_ttft(s) for s in cold],
            "warm_ttft_ms": [_ttft(s) for s in warm],
            "alone_tpot_ms": [_tpot(s) for s in alone],
            "pair_tpot_ms": [[_tpot(a), _tpot(b)] for a, b in pair],
            "rag_ms": rag,
        },
    }


def handle(args: argparse.Namespace) -> int:
    if args.rounds < 1 or args.tokens < 2:
        raise UsageError("--rounds must be >= 1 and --tokens >= 2")
    config, key = _config(read_base_config(args.config))
    with tempfile.TemporaryDirectory(prefix="llamagate-bench-models-") as folder:
        launched = start_llamagate(config, key, Path(folder), progress=ConsoleProgress())
        try:
            measured = asyncio.run(_measure(launched.target, args.rounds, args.tokens))
        finally:
            launched.stop()
    results = {
        "command": cli.command_line("models"),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "identity": launched.identity,
        "rounds": args.rounds,
        "tokens": args.tokens,
        **measured,
    }
    print(json.dumps(results, indent=2, default=str))
    print(f"medians: {json.dumps(results['median'])}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2, default=str) + "\n", encoding="utf-8")
    return 0


async def _rag(client: httpx.AsyncClient, target: Target) -> dict[str, float]:
    question = "Who kept the lighthouse on the northern cape?"
    started = time.monotonic()
    body: dict[str, Any] = {"model": "embed", "input": question}
    r = await client.post(target.api_root + "/embeddings", json=body, headers=target.headers())
    r.raise_for_status()
    embedded = time.monotonic()
    context = "The northern lighthouse was kept by Ada Sørensen from 1901 to 1934."
    body = {
        "model": "chat",
        "messages": [{"role": "user", "content": f"Context: {context}\nQuestion: {question}"}],
        "max_tokens": 16,
        "temperature": 0,
    }
    r = await client.post(target.api_root + "/chat/completions", json=body, headers=target.headers())
    r.raise_for_status()
    done = time.monotonic()
    return {
        "embed": (embedded - started) * 1000,
        "chat": (done - embedded) * 1000,
        "total": (done - started) * 1000,
    }


def main() -> int:
    return cli.run("models", __doc__, add_arguments, handle)


if __name__ == "__main__":
    raise SystemExit(main())
