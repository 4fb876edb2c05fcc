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
import datetime
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from supervisor.bench.launcher import deep_merge, llamagate_overrides, read_base_config, start_llamagate
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


class _Stream:
    """One streamed chat answer: time to first token from the request's start, and time per token."""

    def __init__(self) -> None:
        self.ttft_ms: float | None = None
        self.tpot_ms: float | None = None
        self.tokens = 0
        self.error: str | None = None


def _stream(client: httpx.Client, base: str, key: str, model: str, tokens: int, out: _Stream) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    started = time.monotonic()
    stamps: list[float] = []
    try:
        headers = {"Authorization": f"Bearer {key}"}
        with client.stream("POST", f"{base}/v1/chat/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                out.error = f"HTTP {response.status_code}: {response.read()[:200]!r}"
                return
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                choices = event.get("choices") or []
                if choices and (choices[0].get("delta") or {}).get("content"):
                    stamps.append(time.monotonic())
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        return
    out.tokens = len(stamps)
    if stamps:
        out.ttft_ms = (stamps[0] - started) * 1000
    if len(stamps) > 1:
        out.tpot_ms = (stamps[-1] - stamps[0]) * 1000 / (len(stamps) - 1)


def _state(client: httpx.Client, base: str, key: str, model: str) -> str:
    r = client.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {key}"})
    r.raise_for_status()
    return str(next(m["llamagate"]["state"] for m in r.json()["data"] if m["id"] == model))


def _wait_unloaded(client: httpx.Client, base: str, key: str, model: str) -> None:
    deadline = time.monotonic() + IDLE_UNLOAD_S + 60
    while _state(client, base, key, model) != "unloaded":
        if time.monotonic() > deadline:
            raise RuntimeError(f"{model} was not unloaded within its idle time + 60 s")
        time.sleep(0.2)


def _one(client: httpx.Client, base: str, key: str, model: str, tokens: int) -> _Stream:
    out = _Stream()
    _stream(client, base, key, model, tokens, out)
    if out.error:
        raise RuntimeError(f"{model}: {out.error}")
    return out


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 1) if present else None


def handle(args: argparse.Namespace) -> int:
    if args.rounds < 1 or args.tokens < 2:
        raise UsageError("--rounds must be >= 1 and --tokens >= 2")
    config, key = _config(read_base_config(args.config))
    cold: list[_Stream] = []
    warm: list[_Stream] = []
    alone: list[_Stream] = []
    pair: list[tuple[_Stream, _Stream]] = []
    rag: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="llamagate-bench-models-") as folder:
        launched = start_llamagate(config, key, Path(folder), progress=ConsoleProgress())
        base = launched.target.server_root
        try:
            with httpx.Client(timeout=600, trust_env=False) as client:
                for _ in range(args.rounds):
                    _wait_unloaded(client, base, key, "chat-od")
                    cold.append(_one(client, base, key, "chat-od", 8))
                    warm.append(_one(client, base, key, "chat-od", 8))
                for _ in range(args.rounds):
                    alone.append(_one(client, base, key, "chat", args.tokens))
                    a, b = _Stream(), _Stream()
                    threads = [
                        threading.Thread(target=_stream, args=(client, base, key, m, args.tokens, s))
                        for m, s in (("chat", a), ("chat-od", b))
                    ]
                    for t in threads:
                        t.start()
                    for t in threads:
                        t.join()
                    if a.error or b.error:
                        raise RuntimeError(f"two at once: {a.error or b.error}")
                    pair.append((a, b))
                for _ in range(args.rounds):
                    rag.append(_rag(client, base, key))
        finally:
            launched.stop()
    results = {
        "command": cli.command_line("models"),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "identity": launched.identity,
        "rounds": args.rounds,
        "tokens": args.tokens,
        "median": {
            "on_demand_ttft_ms": {
                "cold": _median([s.ttft_ms for s in cold]),
                "warm": _median([s.ttft_ms for s in warm]),
            },
            "tpot_ms": {
                "chat_alone": _median([s.tpot_ms for s in alone]),
                "chat_with_other": _median([a.tpot_ms for a, _ in pair]),
                "other_with_chat": _median([b.tpot_ms for _, b in pair]),
            },
            "rag_ms": {k: _median([r[k] for r in rag]) for k in ("embed", "chat", "total")},
        },
        "samples": {
            "cold_ttft_ms": [s.ttft_ms for s in cold],
            "warm_ttft_ms": [s.ttft_ms for s in warm],
            "alone_tpot_ms": [s.tpot_ms for s in alone],
            "pair_tpot_ms": [[a.tpot_ms, b.tpot_ms] for a, b in pair],
            "rag_ms": rag,
        },
    }
    print(json.dumps(results, indent=2, default=str))
    m = results["median"]
    print(f"medians: {json.dumps(m)}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2, default=str) + "\n", encoding="utf-8")
    return 0


def _rag(client: httpx.Client, base: str, key: str) -> dict[str, float]:
    headers = {"Authorization": f"Bearer {key}"}
    question = "Who kept the lighthouse on the northern cape?"
    started = time.monotonic()
    r = client.post(f"{base}/v1/embeddings", json={"model": "embed", "input": question}, headers=headers)
    r.raise_for_status()
    embedded = time.monotonic()
    context = "The northern lighthouse was kept by Ada Sørensen from 1901 to 1934."
    body = {
        "model": "chat",
        "messages": [{"role": "user", "content": f"Context: {context}\nQuestion: {question}"}],
        "max_tokens": 16,
        "temperature": 0,
    }
    r = client.post(f"{base}/v1/chat/completions", json=body, headers=headers)
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
